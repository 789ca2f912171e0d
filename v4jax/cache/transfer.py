"""A request's whole state as plain arrays, to move it from one engine to another (prefill/decode disaggregation).

    rows = request_rows(cfg, layout, full_pages, swa_table_row, fed)    # host: where its state lives in the pools
    arrays = gather_request(cfg, layout, pools, slot, rows...)           # device (jitted by the engine)
    state = RequestState(meta, cut(arrays))                             # numpy, exact sizes, JSON-able meta
    check_state(state, fmt, shapes)                                     # on the receiving side: same format?
    pools = scatter_request(cfg, layout, pools, slot, ...)              # device: into the receiver's own pages

What moves, for a request that has computed positions [0, fed) (after its prefill: fed = the prompt's length):
  c4_kv / c4_index / c128_kv   the compressed entries it has completed, entry order: [n, fed // m, K] per stack
  swa                          the window rows of positions max(0, fed - W + 1) .. fed - 1 (what the next query
                               reads), [n, rows, K] per stack; the MTP block's window (mtp_swa) likewise
  compressor_state             the slot's partial windows of every compressor (main, indexer, HCA; the CSA
                               overlap halves are part of them), [n, C*m, C*K] per stack
  draft_state                  the MTP drafter's per-slot streams (speculative decoding)
  token coordinates, sampler   in `meta`: token ids (prompt and output), position, seed, sample index, stop ids
The arrays are laid out by position and entry, not by page: the receiver may use another page size, or the dense
layout, and maps them into its own pages. Both sides must hold the same model (configuration and
weights, by digest) and the same pool format (`format_of`): a mismatch is refused by name. Boundary snapshots of
the prefix cache stay where they were made (the receiver's own decode saves those of the pages it completes)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from v4jax.cache.pools import FP8, KVPools, PoolLayout
from v4jax.config import CSA, SLIDING, ModelConfig, layer_stacks

FORMAT_VERSION = 2  # 2: the weights' digest
_STATE_FIELDS = ("state_kv", "state_score", "idx_state_kv", "idx_state_score")
# the pool each array counts under (the names of stats()["pools"])
POOLS = ("swa", "c4_kv", "c4_index", "c128_kv", "compressor_state", "mtp_swa", "draft_state")


class TransferError(ValueError):
    """A request's state that this engine cannot take (another format, a truncated or corrupted payload)."""


def format_of(cfg: ModelConfig, kv_dtype, weights: str) -> dict:
    """What must be equal on both sides: the model's configuration (a digest), its weights (the digest the engine
    computed once, v4jax.model.weights.weights_checksum) and the pools' storage."""
    name = FP8 if isinstance(kv_dtype, str) else np.dtype(kv_dtype).name
    return {"version": FORMAT_VERSION, "config": hashlib.sha256(repr(cfg).encode()).hexdigest()[:32],
            "weights": weights, "kv_dtype": name}


_FORMAT_KEYS = {"version": "transfer format version", "config": "model configuration",
                "weights": "weights digest (another checkpoint, or another seed of this configuration)",
                "kv_dtype": "KV-cache format (kv_cache_dtype)"}


def check_format(got: dict, fmt: dict) -> None:
    """TransferError unless a state's format `got` (its meta["format"]) is this engine's `fmt`, naming what
    differs."""
    for key, what in _FORMAT_KEYS.items():
        if got.get(key) != fmt[key]:
            raise TransferError(f"the request's state has a {what} ({key}: {got.get(key)!r}) other than this "
                                f"engine's ({fmt[key]!r}): both sides must serve the same model with the same "
                                "kv_cache_dtype")


def pool_of(name: str) -> str:
    return name.split("/", 1)[0]


def _stack_pools(cfg: ModelConfig):
    """(stack index, stack, {field: pool name}) of every layer stack."""
    for g, st in enumerate(layer_stacks(cfg).stacks):
        fields = {"swa": "swa"}
        if st.kind == CSA:
            fields.update(kv="c4_kv", idx="c4_index")
        elif st.kind != SLIDING:
            fields["kv"] = "c128_kv"
        if st.kind != SLIDING:
            fields.update({f: "compressor_state" for f in _STATE_FIELDS if f.startswith("state") or st.kind == CSA})
        yield g, st, fields


def window_start(cfg: ModelConfig, fed: int) -> int:
    """The first position the next query (at `fed`) reads from the window."""
    return max(0, fed - (cfg.window_size - 1))


def expected_shapes(cfg: ModelConfig, pools_like: KVPools, fed: int, draft: bool) -> dict[str, tuple]:
    """name -> (shape, dtype) of every array of a request at position `fed` (pools_like: the pools or their
    abstract shapes, for the per-row widths and dtypes)."""
    out = {}
    n_win = fed - window_start(cfg, fed)
    for g, st, fields in _stack_pools(cfg):
        lp = pools_like.stacks[g]
        for f, pool in fields.items():
            a = getattr(lp, f)
            if f == "swa":
                shape = (a.shape[0], n_win, a.shape[2])
            elif f in ("kv", "idx"):
                shape = (a.shape[0], fed // st.ratio, a.shape[2])
            else:
                shape = (a.shape[0],) + tuple(a.shape[2:])
            out[f"{pool}/{g}/{f}"] = (shape, np.dtype(a.dtype).name)
    if draft:
        d = pools_like.draft
        out["mtp_swa/draft/swa"] = ((d.swa.shape[0], n_win, d.swa.shape[2]), np.dtype(d.swa.dtype).name)
        if d.hidden is None:  # a drafter without per-slot state
            return out
        out["draft_state/draft/hidden"] = ((1,) + tuple(d.hidden.shape[2:]), np.dtype(d.hidden.dtype).name)
        out["draft_state/draft/position"] = ((2,), "int32")  # the drafter's start and count
        out["draft_state/draft/tokens"] = ((1,), "int32")
    return out


# ---- host: where a request's state lives ----
def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def page_rows(layout: PoolLayout, full_pages, n_pages: int) -> np.ndarray:
    """The slot's first full pages padded to a power of two (-1 past them): the gather's static length."""
    out = np.full(_pow2(max(n_pages, 1)), -1, np.int32)
    out[:n_pages] = full_pages[:n_pages]
    return out


def swa_rows(cfg: ModelConfig, layout: PoolLayout, swa_table_row: np.ndarray, fed: int) -> np.ndarray:
    """[W] SWA rows of positions fed-W+1 .. fed-1 (W = window; -1 where a position is before 0 or unmapped)."""
    w, ps = cfg.window_size, layout.swa_page_size
    pos = fed - (w - 1) + np.arange(w - 1)
    page = np.where(pos >= 0, swa_table_row[np.clip(pos // ps, 0, len(swa_table_row) - 1)], -1)
    return np.where((pos >= 0) & (page >= 0), page * ps + pos % ps, -1).astype(np.int32)


def entry_rows(layout: PoolLayout, full_pages: np.ndarray, ratio: int, n_entries: int) -> np.ndarray:
    """Rows of entries 0 .. n_entries-1 of a ratio's pools in these pages, padded to a power of two with an
    out-of-range row (a scatter drops it)."""
    per = layout.page_size // ratio
    e = np.arange(n_entries)
    rows = full_pages[e // per] * per + e % per
    out = np.full(_pow2(max(n_entries, 1)), layout.n_pages * per, np.int32)
    out[:n_entries] = rows
    return out


def gather_inputs(cfg: ModelConfig, layout: PoolLayout, full_row: np.ndarray, swa_row: np.ndarray, fed: int):
    """(pages, window rows) the gather of a slot at position `fed` reads, from the slot's page-table rows."""
    return page_rows(layout, full_row, -(-fed // layout.page_size)), swa_rows(cfg, layout, swa_row, fed)


def cut(cfg: ModelConfig, padded: dict, shapes: dict) -> dict:
    """The gather's padded host arrays cut to `shapes` (expected_shapes): the window's last positions (those before
    position 0 go), the first entries of each compressed pool."""
    out = {}
    for name, (shape, _) in shapes.items():
        a = np.asarray(padded[name])
        leaf = name.rsplit("/", 1)[1]
        if leaf == "swa":
            a = a[:, a.shape[1] - shape[1]:]
        elif leaf in ("kv", "idx"):
            a = a[:, :shape[1]]
        out[name] = np.ascontiguousarray(a)
    return out


def scatter_inputs(cfg: ModelConfig, layout: PoolLayout, arrays: dict, full_row: np.ndarray, swa_row: np.ndarray,
                   fed: int, tokens) -> tuple:
    """(arrays, entries, window rows, token rows, token ids): what scatter_request takes to write a state at
    position `fed` into a slot with these page-table rows, padded to powers of two (rows past the data out of
    range, so the scatter drops them). tokens: the request's token ids at positions 0 .. fed-1."""
    w_rows = swa_rows(cfg, layout, swa_row, fed)
    n_win = fed - window_start(cfg, fed)
    dropped = layout.n_swa_pages * layout.swa_page_size
    win = np.where((np.arange(len(w_rows)) >= len(w_rows) - n_win) & (w_rows >= 0), w_rows, dropped).astype(np.int32)
    entries = {m: entry_rows(layout, full_row, m, fed // m) for m in cfg.ratios_in_use}
    ratio = {str(g): st.ratio for g, st, _ in _stack_pools(cfg)}
    padded = {}
    for name, a in arrays.items():
        _, g, leaf = name.split("/")
        if leaf == "swa":  # right-aligned in the window's W-1 rows
            pad = np.zeros((a.shape[0], len(w_rows)) + a.shape[2:], a.dtype)
            pad[:, len(w_rows) - a.shape[1]:] = a
            a = pad
        elif leaf in ("kv", "idx"):
            pad = np.zeros((a.shape[0], len(entries[ratio[g]])) + a.shape[2:], a.dtype)
            pad[:, :a.shape[1]] = a
            a = pad
        padded[name] = a
    p, n = layout.page_size, len(tokens)
    tok_rows = np.full(_pow2(max(n, 1)), layout.n_pages * p, np.int32)
    pos = np.arange(n)
    tok_rows[:n] = full_row[pos // p] * p + pos % p
    tok_ids = np.zeros(len(tok_rows), np.int32)
    tok_ids[:n] = tokens
    return padded, entries, win, tok_rows, tok_ids


# ---- device: gather and scatter (pure; the engine jits them) ----
def gather_request(cfg: ModelConfig, layout: PoolLayout, pools: KVPools, slot, pages, swa) -> dict:
    """Every array of the slot's request, padded: compressed entries of `pages` ([NP] page ids, -1 = none: read as
    page 0 and cut by the host), window rows `swa` ([W-1] rows, -1 = none), the slot's compressor states."""
    pages = jnp.maximum(pages, 0)
    win = jnp.maximum(swa, 0)
    out = {}
    for g, st, fields in _stack_pools(cfg):
        lp = pools.stacks[g]
        for f, pool in fields.items():
            a = getattr(lp, f)
            if f == "swa":
                v = a[:, win]
            elif f in ("kv", "idx"):
                per = layout.page_size // st.ratio
                v = a[:, (pages[:, None] * per + jnp.arange(per)[None, :]).reshape(-1)]
            else:
                v = a[:, slot]
            out[f"{pool}/{g}/{f}"] = v
    d = pools.draft
    if d is not None:
        out["mtp_swa/draft/swa"] = d.swa[:, win]
    if d is not None and d.hidden is not None:
        out["draft_state/draft/hidden"] = d.hidden[slot, :1]
        out["draft_state/draft/position"] = jnp.stack([d.start[slot], d.count[slot]])
        out["draft_state/draft/tokens"] = d.tokens[slot, :1]
    return out


def scatter_request(cfg: ModelConfig, layout: PoolLayout, pools: KVPools, slot, arrays: dict, entries: dict, swa,
                    token_rows, token_ids) -> KVPools:
    """The pools with a request's arrays written into a slot: compressed entries at `entries` (ratio -> rows,
    out-of-range rows dropped), window rows at `swa`, token ids at `token_rows` (flat rows of the token pool), the
    compressor states at the slot. Array lengths match their rows (padded by the caller)."""
    stacks = []
    for g, st, fields in _stack_pools(cfg):
        lp = pools.stacks[g]
        upd = {}
        for f, pool in fields.items():
            a, v = getattr(lp, f), arrays[f"{pool}/{g}/{f}"].astype(getattr(lp, f).dtype)
            if f == "swa":
                upd[f] = a.at[:, swa].set(v, mode="drop")
            elif f in ("kv", "idx"):
                upd[f] = a.at[:, entries[st.ratio]].set(v, mode="drop")
            else:
                upd[f] = a.at[:, slot].set(v)
        stacks.append(dataclasses.replace(lp, **upd))
    tokens = pools.tokens.reshape(-1).at[token_rows].set(token_ids, mode="drop").reshape(pools.tokens.shape)
    draft = pools.draft
    if draft is not None:
        draft = dataclasses.replace(
            draft, swa=draft.swa.at[:, swa].set(arrays["mtp_swa/draft/swa"].astype(draft.swa.dtype), mode="drop"))
    if draft is not None and draft.hidden is not None:
        pos = arrays["draft_state/draft/position"]
        draft = dataclasses.replace(
            draft, hidden=draft.hidden.at[slot, :1].set(arrays["draft_state/draft/hidden"].astype(draft.hidden.dtype)),
            start=draft.start.at[slot].set(pos[0]), count=draft.count.at[slot].set(pos[1]),
            tokens=draft.tokens.at[slot, :1].set(arrays["draft_state/draft/tokens"]))
    return dataclasses.replace(pools, tokens=tokens, stacks=tuple(stacks), draft=draft)


# ---- the state on the host ----
@dataclasses.dataclass(frozen=True, eq=False)
class RequestState:
    """One request's state between engines: `meta` (JSON: the request, its position, the pools' format) and
    `arrays` (name -> numpy array at exact size; names "<pool>/<stack>/<field>")."""
    meta: dict
    arrays: dict

    @property
    def request_id(self) -> str:
        return self.meta["request"]["request_id"]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def bytes_by_pool(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, a in self.arrays.items():
            out[pool_of(name)] = out.get(pool_of(name), 0) + a.nbytes
        return out

    def specs(self) -> dict:
        """name -> {"shape", "dtype"}: what a receiver allocates before the bytes arrive."""
        return {k: {"shape": list(a.shape), "dtype": a.dtype.name} for k, a in sorted(self.arrays.items())}


def checksum(arrays: dict) -> str:
    """A digest of every array's name, shape, dtype and bytes (sorted by name): one per transfer. The bytes go
    through CRC-32, the check made for transmission errors (the shared secret, not this, keeps strangers out):
    23 MB in 7-12 ms where blake2b took 32-40 (a 32K flash-slice request's size; computed once on each side, the
    blake2b digest was most of a transfer's time: `python scripts/transfer_probe.py --state` on 2 CPU cores)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        crc = zlib.crc32(a.view(np.uint8).reshape(-1).data) if a.size else 0
        h.update(f"{name}|{a.dtype.name}|{a.shape}|{a.nbytes}|{crc:08x}|".encode())
    return h.hexdigest()


def check_state(state: RequestState, fmt: dict, shapes: dict) -> None:
    """TransferError unless the state has this engine's format and exactly the arrays `shapes` expects."""
    check_format(state.meta.get("format", {}), fmt)
    missing = sorted(set(shapes) - set(state.arrays))
    if missing:
        raise TransferError(f"the request's state lacks array(s) {missing}" + (
            " (the drafter's state: enable speculative_config on the prefill side too)"
            if any(m.startswith(("mtp_swa", "draft_state")) for m in missing) else ""))
    for name, (shape, dtype) in shapes.items():
        a = state.arrays[name]
        if tuple(a.shape) != tuple(shape) or a.dtype.name != dtype:
            raise TransferError(f"array {name!r} of the request's state is {a.dtype.name}{list(a.shape)}; this "
                                f"engine expects {dtype}{list(shape)} (truncated or from another layout)")


# ---- bytes (the HTTP path, and files) ----
def to_bytes(state: RequestState) -> bytes:
    """The state as one byte string: an 8-byte header length, a JSON header (meta, specs, checksum), the arrays'
    raw bytes in the header's order."""
    names = sorted(state.arrays)
    header = json.dumps({"meta": state.meta, "specs": state.specs(), "order": names,
                         "checksum": checksum(state.arrays)}).encode()
    # one copy of the arrays' bytes (the join), not three (tobytes, the buffer, getvalue)
    return b"".join([len(header).to_bytes(8, "little"), header] +
                    [np.ascontiguousarray(state.arrays[n]).reshape(-1).view(np.uint8).data for n in names])


def from_bytes(data: bytes) -> RequestState:
    """to_bytes' inverse; TransferError for a truncated or corrupted payload (its checksum differs)."""
    if len(data) < 8:
        raise TransferError(f"the state payload is truncated ({len(data)} bytes)")
    n = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise TransferError(f"the state payload's header is corrupted: {e}") from None
    arrays, at = {}, 8 + n
    for name in header["order"]:
        spec = header["specs"][name]
        dt = np.dtype(jnp.dtype(spec["dtype"]))
        size = int(np.prod(spec["shape"])) * dt.itemsize
        if at + size > len(data):
            raise TransferError(f"the state payload is truncated: array {name!r} needs {size} bytes, "
                                f"{len(data) - at} remain")
        arrays[name] = np.frombuffer(data, dt, int(np.prod(spec["shape"])), at).reshape(spec["shape"])
        at += size
    if at != len(data):
        raise TransferError(f"the state payload has {len(data) - at} bytes past its arrays")
    verify(arrays, header["checksum"])
    return RequestState(header["meta"], arrays)


def verify(arrays: dict, want: str) -> None:
    got = checksum(arrays)
    if got != want:
        raise TransferError(f"the request's state is corrupted: checksum {got} != {want} sent")


def specs_to_dtypes(specs: dict) -> dict:
    """name -> (shape, numpy dtype) from RequestState.specs()."""
    return {k: (tuple(v["shape"]), np.dtype(jnp.dtype(v["dtype"]))) for k, v in specs.items()}


def jax_struct(shape, dtype, device=None):
    """A ShapeDtypeStruct on one device (what a transfer pull allocates)."""
    device = device or jax.devices()[0]
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))
