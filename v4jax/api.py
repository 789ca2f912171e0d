"""The user-facing API: `LLM`, `SamplingParams`, `RequestOutput`.

    llm = LLM("path/to/hf-checkpoint")            # or a preset name, or LLM() = the embedded default model
    outs = llm.generate(["To be, or not"], SamplingParams(max_tokens=64, temperature=0.8, seed=0))
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import signal
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from v4jax.config import PRESETS, ModelConfig, preset
from v4jax.detokenize import IncrementalDetokenizer
from v4jax.engine.checks import RequestCheck, RequestError, check_prompt_ids
from v4jax.engine.sampling import SamplingParams, top_alternatives
from v4jax.engine.spec import speculative_method, speculative_tokens
from v4jax.fields import MAX_TOP_LOGPROBS, FieldError, check_field
from v4jax.model import RunOptions, Transformer, quant

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(__file__), "default_model")
_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    logprobs: list[float] | None
    finish_reason: str  # "stop" | "length"
    # with SamplingParams.top_logprobs = N: per generated token, the N most likely (token id, log-prob) pairs
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclasses.dataclass
class PromptLogprobs:
    """A prompt scored by one teacher-forced forward: for each token, log-softmax of the raw logits of the
    positions before it (None for the first token, which nothing predicts)."""
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]  # the top_n most likely (token id, log-prob) pairs


@dataclasses.dataclass
class _Event:
    request_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    top_logprobs: list = dataclasses.field(default_factory=list)


class _Call:
    """One generate call's requests (id -> prompt index) and its inbox: the events of its requests, put there by
    whichever caller steps the engine."""

    def __init__(self):
        self.index: dict[str, int] = {}
        self.inbox: collections.deque[_Event] = collections.deque()


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Options of `LLM(..., **options)`; unknown names are an error."""
    quant_sim: bool = False
    # How the weights the release quantises are held. None: as the checkpoint stores them (FP8 e4m3 linears with
    # 128x128 ue8m0 block scales, FP4 e2m1 routed experts with 1x32 scales: dequantized inside each matmul, whose
    # input is rounded to FP8 as the release computes); a preset's in `dtype`. "none": every weight dequantized to
    # `dtype` at load. "fp8": the release's formats (FP8 linears, FP4 experts), a checkpoint must hold them.
    quantization: str | None = None
    # the pools' storage: "auto" (the model's dtype), "bfloat16", or "fp8": the release's formats (FP8 window and
    # compressed entries, 584 B for Flash; FP4 indexer keys, 68 B), written quantised, decoded where read
    kv_cache_dtype: str = "auto"
    attention_impl: str | None = None  # "xla" | "pallas"; default: "pallas" on a GPU (its kernels are the fast path
    # there: BENCHMARKS.md), "xla" elsewhere (on CPU the kernels run interpreted; on TPU only their lowering is checked)
    seed: int = 0  # weights of a random preset
    max_model_len: int | None = None  # context limit (prompt + generated); default: the config's
    max_num_seqs: int = 8  # decode slots
    kv_layout: str = "paged"  # "paged" | "dense"
    page_size: int | None = None  # tokens per full page; default: 256 rounded up to the lcm of the ratios
    decode_steps: int = 8  # tokens per jitted decode call
    # tokens of one prefill step (one chunk, or several requests' chunks as rows). The H200, flash-slice, 32 slots:
    # a 128K prompt prefilled in 3.60 s at 256, 1.56 s at 2048, 1.39 s at 8192; 32 prompts of 4K in 1.33 s at
    # 2048 (a step of 2048 tokens already fills the GPU). Every chunk length is a program to compile: 2048 keeps
    # their number lower than 8192 for 12 % at 128K.
    prefill_chunk: int = 2048
    memory_budget_bytes: int | None = None  # size the pools from this budget instead of max_num_seqs * max_model_len
    # vLLM's option: the share of each device's memory the weights and pools may take; the pools get what the
    # weights leave of it (more pages than max_num_seqs x max_model_len need: room for the prefix cache). A
    # device's memory is what it reports to JAX: on a GPU XLA's share of the card ($XLA_PYTHON_CLIENT_MEM_FRACTION,
    # 0.75 by default). The steps' temporaries are checked against what is left (LLM.warmup).
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True  # reuse cached full pages of earlier requests' prefixes (paged layout)
    mesh: str | None = None  # e.g. "expert=4" or "data=2,tensor=2" (sharding/ maps logical axes to it), over
    # every process's devices once jax.distributed runs (sharding.multihost.initialize, called by LLM)
    # {"method": "mtp" | "dspark", "num_speculative_tokens": k} (vLLM's shape): each decode step drafts k tokens
    # with the model's MTP block, or the DSpark drafter of the 0731 / -DSpark releases (k <= dspark_block_size),
    # and verifies them in one step (v4jax.engine.spec); greedy outputs are unchanged, sampled ones distributed
    # as plain sampling's
    speculative_config: dict | None = None
    # host offload of the C4 KV pool (HiSparse): every CSA layer's compressed entries in host memory (pinned), a
    # device buffer of hisparse_device_pages pages' worth of hot entries (LRU); the entries each step's top-k
    # selects are fetched before attention reads them (v4jax.model.offload). Default size: four decode steps'
    # selections (max_num_seqs x index_topk entries each).
    enable_hisparse: bool = False
    hisparse_device_pages: int | None = None

    def __post_init__(self):
        # every option by the rule table (v4jax.fields): ints are ints in range (int32; bytes int64), bools are
        # bools, choices are strings among the choices, the mesh is a string; the message names the option
        for f in dataclasses.fields(self):
            if f.name == "speculative_config":
                continue
            rule = "weights_seed" if f.name == "seed" else f.name
            object.__setattr__(self, f.name, check_field(rule, getattr(self, f.name), field=f.name))
        speculative_tokens(self.speculative_config, self.decode_steps)  # a FieldError naming the option
        if self.gpu_memory_utilization is not None and self.memory_budget_bytes is not None:
            raise FieldError("gpu_memory_utilization", "gpu_memory_utilization and memory_budget_bytes both size the "
                             "pools: give one of them")
        if self.enable_hisparse and self.mesh:  # before anything loads (the layout says the same to its callers)
            raise FieldError("enable_hisparse", f"enable_hisparse keeps one device's C4 KV pool in host memory: "
                             f"mesh={self.mesh!r} is not supported with it (leave out mesh, or enable_hisparse)")

    @property
    def num_speculative_tokens(self) -> int:
        """k of speculative_config (0: no speculation)."""
        return speculative_tokens(self.speculative_config, self.decode_steps)


def _load_tokenizer(path: str):
    """The directory's tokenizer.json, or None (with one warning: prompts must then be token ids)."""
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        warnings.warn(f"no tokenizer.json in {path}: prompts must be token ids, outputs have text=None",
                      stacklevel=4)
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(path, "tokenizer.json"))


def _read_config(path: str) -> ModelConfig:
    """ModelConfig.from_hf, with an unreadable config.json reported as a ConfigError naming the file."""
    import json

    from v4jax.config import ConfigError
    try:
        return ModelConfig.from_hf(path)
    except json.JSONDecodeError as e:
        cfg_file = path if os.path.isfile(path) else os.path.join(path, "config.json")
        if not os.path.exists(cfg_file):
            cfg_file = os.path.join(path, "inference", "config.json")
        raise ConfigError(f"{cfg_file} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config.json in {path} is not UTF-8 text: {e}") from None


def _weight_format(quantization: str | None, stored: quant.WeightFormat | None, what: str) -> quant.WeightFormat:
    """The model's quant.WeightFormat for the `quantization` option, given what the checkpoint stores (None: a
    preset, which has no storage of its own)."""
    if quantization == "none":
        return quant.DEQUANTIZED
    if quantization is None:
        return stored or quant.DEQUANTIZED
    if stored is not None and stored != quant.RELEASE:
        raise FieldError("quantization", f"quantization={quantization!r}: {what} stores FP8 linears as "
                         f"{stored.linear or 'float'} and routed experts as {stored.experts or 'float'}, not FP8 / "
                         f"FP4; load it with quantization=None (as stored) or 'none'")
    return quant.RELEASE


def _check_stored_experts_split(abstract, mesh_rules, what: str) -> None:
    """Routed experts kept as stored run per shard (shard_map): each shard dequantizes its own block of values
    with its own block of scales, so the mesh must split a scale array as it splits its values."""
    from sharding.place import variable_axes
    flat = {tuple(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(abstract))}
    for path, scale in flat.items():
        if len(path) < 2 or path[-2] != "experts" or not path[-1].endswith("_scale"):
            continue
        values = flat[path[:-1] + (path[-1][: -len("_scale")],)]
        axes = variable_axes(values)
        got, want = mesh_rules.spec(axes, scale.shape), mesh_rules.spec(axes, values.shape)
        if got != want:
            raise FieldError("quantization", f"{what}: the mesh splits {'.'.join(path[:-1])} as {want} but its "
                             f"block scales {tuple(scale.shape)} as {got}; load it with quantization='none' or use a "
                             "mesh whose axes divide the scale blocks")


def _check_expert_width_split(cfg: ModelConfig, mesh_rules, mesh: str) -> None:
    """The release's rounding of w2's input (quant_sim, or experts kept as stored) takes blocks of 128 along the
    expert width, which each shard rounds on its own: a mesh may split the width only into multiples of 128."""
    from v4jax.model.moe import EXPERT_DOWN_AXES
    shape = (cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim)
    axes = mesh_rules.spec(EXPERT_DOWN_AXES, shape)[-1]
    ways = 1 if axes is None else int(np.prod([mesh_rules.mesh.shape[a] for a in ((axes,) if isinstance(axes, str)
                                                                                  else axes)]))
    if ways > 1 and (cfg.moe_inter_dim // ways) % quant.FP8_BLOCK:
        raise FieldError("mesh", f"mesh={mesh!r} splits the routed experts' width {cfg.moe_inter_dim} into "
                         f"{ways} shards of {cfg.moe_inter_dim // ways}: the release's FP8 rounding of their "
                         f"down projection's input takes blocks of {quant.FP8_BLOCK} (quant_sim, or experts kept as "
                         "stored); use a mesh whose `tensor` axis leaves whole blocks, or quantization='none' "
                         "without quant_sim")


def load_model(spec: str | None, dtype, seed: int = 0, mesh_rules=None,
               quantization: str | None = None) -> tuple[ModelConfig, Transformer, object, str]:
    """(config, model, tokenizer or None, description) for a preset name, an HF-format directory or an orbax
    checkpoint directory (`convert`). `quantization`: see EngineOptions.

    Before anything is allocated, the weights' bytes on one device (of the abstract model, split as the mesh's
    rules split them) are checked against its memory (`v4jax.memory.check_weights_fit`). With `mesh_rules`
    (sharding.MeshRules) every parameter is created, or read from the checkpoint, straight into its shards; the
    checkpoint reader rejects a tensor holding NaN or infinity (corrupt bytes), naming it."""
    from sharding.place import create_model
    from v4jax import memory as M

    mesh = None if mesh_rules is None else dict(mesh_rules.mesh.shape)

    if spec is None:
        if os.path.exists(os.path.join(DEFAULT_MODEL_DIR, "model.safetensors")):
            spec = DEFAULT_MODEL_DIR
        else:
            warnings.warn("the embedded default model is missing from this install; using the random 'tiny' preset")
            spec = "tiny"
    if spec in PRESETS:
        cfg = preset(spec)
        # param_bytes is the abstract model's byte count (nnx.eval_shape: tests/test_newcomer.py checks they
        # agree) without its cost: eval_shape of `flash` alone takes ~10 s, of `pro` ~25 s.
        weights = _weight_format(quantization, None, f"preset {spec!r}")
        M.check_weights_fit(cfg, M.weight_bytes_on_mesh(cfg, mesh, jnp.dtype(dtype).itemsize, weights), dtype,
                            what=f"preset {spec!r}", weights=weights)
        warnings.warn(f"preset {spec!r}: random weights (seed {seed}); no tokenizer, prompts are token ids",
                      stacklevel=3)
        if mesh_rules is not None and weights.experts is not None:
            _check_stored_experts_split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype,
                                                                           weights=weights)), mesh_rules, spec)
        model = create_model(lambda: Transformer(cfg, rngs=nnx.Rngs(seed), dtype=dtype, weights=weights), mesh_rules)
        return cfg, model, None, f"preset {spec}"
    if not os.path.isdir(spec):
        hint = "" if os.path.exists(spec) else " (no such file or directory)"
        raise FileNotFoundError(f"model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
                                f"checkpoint directory{hint}")
    from checkpoints import open_checkpoint, orbax_io
    from v4jax.model.weights import load_tensors

    cfg = _read_config(spec)
    if orbax_io.is_orbax_dir(spec):  # written by `v4jax convert`, restored onto this mesh
        return cfg, _restore_orbax(spec, cfg, dtype, mesh_rules, mesh, quantization), _load_tokenizer(spec), spec
    ckpt = open_checkpoint(spec, cfg)
    if not ckpt.has_mtp and cfg.n_mtp_layers:
        what = "the DSpark drafter" if cfg.dspark_block_size else "MTP"
        warnings.warn(f"{spec}: no mtp.* weights; {what} is off", stacklevel=3)
    weights = _weight_format(quantization, quant.WeightFormat(*ckpt.weight_format()), spec)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype, mtp=ckpt.has_mtp,
                                                  weights=weights))
    M.check_weights_fit(cfg, M.weight_bytes_per_device(abstract, mesh), dtype, what=spec, weights=weights)
    if mesh_rules is not None and weights.experts is not None:
        _check_stored_experts_split(abstract, mesh_rules, spec)
    # FP8 linears are kept as stored under both formats (the release's experts could be FP8 too: its first Flash)
    stored = tuple(s for s in (weights.linear, weights.experts) if s is not None)
    model = load_tensors(abstract, ckpt.iter_tensors(progress=True, stored=stored), mesh_rules)
    return cfg, model, _load_tokenizer(spec), spec


def _restore_orbax(path: str, cfg: ModelConfig, dtype, mesh_rules, mesh, quantization=None) -> Transformer:
    """The model from an orbax checkpoint of `v4jax convert`, each array read straight into its shards of
    `mesh_rules` (or onto the first device), in the weight format it was written in."""
    from checkpoints import orbax_io
    from sharding.place import state_shardings
    from v4jax import memory as M

    meta = orbax_io.read_meta(path)
    weights = quant.WeightFormat(*meta.get("weights", (None, None)))
    if quantization is not None and _weight_format(quantization, weights, path) != weights:
        raise FieldError("quantization", f"quantization={quantization!r}: {path} holds its weights as "
                         f"{weights}; convert the checkpoint again with that option")
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), dtype=dtype, mtp=meta["mtp"],
                                                  weights=weights))
    M.check_weights_fit(cfg, M.weight_bytes_per_device(abstract, mesh), dtype, what=path)
    graphdef, state = nnx.split(abstract)
    if mesh_rules is None:
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda v: one, state)
    else:
        shardings = state_shardings(state, mesh_rules)
    target = jax.tree.map(lambda v, sh: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh),
                          nnx.to_pure_dict(state), nnx.to_pure_dict(shardings))
    nnx.replace_by_pure_dict(state, orbax_io.restore(path, target))
    return nnx.merge(graphdef, state)


def convert(src: str, out: str, *, dtype: str = "bfloat16", mesh: str | None = None, progress: bool = True,
            quantization: str | None = None) -> str:
    """An HF-format checkpoint directory (or a preset) -> an orbax checkpoint in `out`, written from the shards
    of `mesh`, its weights held as `quantization` says (EngineOptions); `LLM(out, mesh=...)` restores it onto any
    mesh. Tokenizer files are copied. Returns `out`."""
    import shutil

    from checkpoints import orbax_io
    from sharding import MeshRules, multihost
    multihost.initialize()
    mr = MeshRules.make(mesh)
    cfg, model, _, _ = load_model(src, _DTYPES[dtype], mesh_rules=mr, quantization=quantization)
    os.makedirs(out, exist_ok=True)
    weights = model.weight_format
    orbax_io.save(out, nnx.to_pure_dict(nnx.state(model)), cfg.to_hf_dict(),
                  {"dtype": dtype, "mtp": len(model.mtp) > 0, "mesh": mesh,
                   "weights": [weights.linear, weights.experts], "source": os.path.abspath(src)
                   if os.path.isdir(src) else src}, progress=progress)
    if os.path.isdir(src) and jax.process_index() == 0:
        for name in os.listdir(src):
            if name.startswith("tokenizer") or name in ("special_tokens_map.json", "generation_config.json"):
                shutil.copy(os.path.join(src, name), os.path.join(out, name))
    return out


@contextlib.contextmanager
def _ctrl_c_after_step():
    """On the main thread under Python's default SIGINT handler, a Ctrl-C during an engine step is raised as
    KeyboardInterrupt once the step has ended (a second one at once). Raised inside the step it would leave the
    engine half-updated (pools donated to a call whose results are never stored), and inside JAX's dispatch or
    its garbage-collection callback it can be swallowed, or crash the runtime later."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    caught = []

    def hold(signum, frame):
        if caught:
            raise KeyboardInterrupt
        caught.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt


def _bucket(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (n - 1).bit_length())


class LLM:
    def __init__(self, model: str | os.PathLike | None = None, *, dtype: str = "bfloat16", devices=None,
                 **options):
        """`devices`: the devices `mesh` spans (default: every process's), so that engines of one process can hold
        meshes of their own (a prefill and a decode engine side by side, v4jax.serve.disagg.LocalDisagg)."""
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        known = [f.name for f in dataclasses.fields(EngineOptions)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"unknown LLM option(s) {unknown}; known: {known}")
        self.options = EngineOptions(**options)  # FieldError (a ValueError) naming the option
        from sharding import multihost
        from v4jax import compile_cache
        multihost.initialize()  # one process of several when the environment says so (before any device is used)
        compile_cache.enable()  # before anything compiles
        spec = None if model is None else os.fspath(model)
        from sharding import MeshRules
        if devices is not None and not self.options.mesh:
            raise FieldError("mesh", "devices= places a mesh: give the mesh too (e.g. mesh=\"tensor=4\")")
        self.mesh_rules = MeshRules.make(self.options.mesh, devices)  # over every process's devices by default
        self.config, self.model, self.tokenizer, self.source = load_model(spec, _DTYPES[dtype], self.options.seed,
                                                                          self.mesh_rules, self.options.quantization)
        self.dtype = dtype
        limit = self.options.max_model_len
        if limit is not None and limit > self.config.max_seq_len:
            raise FieldError("max_model_len", f"max_model_len={limit} exceeds this model's context limit of "
                             f"{self.config.max_seq_len} tokens (its config's max_position_embeddings)")
        self.max_model_len = self.config.max_seq_len if limit is None else limit
        if self.mesh_rules is not None and (self.options.quant_sim or self.model.weight_format.experts):
            _check_expert_width_split(self.config, self.mesh_rules, self.options.mesh)
        if self.options.speculative_config is not None:
            self._check_drafter()
        impl = self.options.attention_impl or ("pallas" if jax.default_backend() == "gpu" else "xla")
        self.run_options = RunOptions(quant_sim=self.options.quant_sim, attention_impl=impl, mesh_rules=self.mesh_rules)
        graphdef, state = nnx.split(self.model)
        self._state = state
        # the teacher-forced forward rounds the keys as this engine's pools store them: it is the reference its
        # generated tokens and log-probs are held to, and what prompt log-probs score with
        kvd = self.options.kv_cache_dtype
        rounds = kvd == "fp8" or (kvd == "bfloat16" and _DTYPES[dtype] != jnp.bfloat16)
        opts = dataclasses.replace(self.run_options, cache_dtype=kvd if rounds else None)
        mr = self.mesh_rules

        @jax.jit
        def forward(state, tokens):
            logits = nnx.merge(graphdef, state)(tokens, opts)
            return logits if mr is None else mr.replicate(logits)  # every process reads the whole of it

        @functools.partial(jax.jit, static_argnums=2)
        def score(state, tokens, n_top):
            # log-softmax on device: the host gets [T] and [T, n_top], never [T, vocab]
            logits = nnx.merge(graphdef, state)(tokens, opts)[0].astype(jnp.float32)
            all_logprobs = jax.nn.log_softmax(logits[:-1], axis=-1)  # row t predicts token t + 1
            chosen = jnp.take_along_axis(all_logprobs, tokens[0, 1:, None], axis=-1)[:, 0]
            top = top_alternatives(all_logprobs, n_top)
            out = (chosen, top)
            return out if mr is None else mr.replicate(out)

        self._forward = forward
        self._score = score
        self._engine = None
        # One engine serves every generate call, from any thread: one caller at a time steps it (its pools are
        # donated to each step) while the others wait for their events; adds and aborts happen between steps.
        self._cond = threading.Condition(threading.Lock())  # not reentrant: see _drop
        self._stepping = False
        self._owners: dict[str, _Call] = {}  # request id -> the call its events go to
        self._dropped: collections.deque[_Call] = collections.deque()  # calls nobody reads, to abort
        self._check = None
        self._rejected = 0  # requests generate refused before they reached the engine
        if self.options.enable_hisparse:
            self.request_check  # the offload's option checks (v4jax.cache.layout.hot_buffer_rows), at load

    def _check_drafter(self) -> None:
        """speculative_config against the drafter the weights hold: a FieldError naming the option if it cannot run."""
        conf, have = self.options.speculative_config, self.model.drafter
        method, k = speculative_method(conf), self.options.num_speculative_tokens
        if method == "mtp" and have != "mtp":
            what = ("the DSpark drafter (its config has dspark_* keys): use method 'dspark'" if have == "dspark"
                    else "no MTP weights (mtp.*)")
            raise FieldError("speculative_config", f"speculative_config {conf} needs the model's MTP block, and "
                             f"{self.source} has {what}")
        if method == "dspark" and have != "dspark":
            what = ("no DSpark drafter weights (mtp.N.* draft layers with main_proj, markov_head and "
                    "confidence_head)" if self.config.dspark_block_size else
                    "no DSpark drafter (no dspark_* keys in its config)" + (": use method 'mtp' for its MTP block"
                                                                           if have == "mtp" else ""))
            raise FieldError("speculative_config", f"speculative_config {conf} needs the DSpark drafter of the "
                             f"0731 / -DSpark releases, and {self.source} has {what}")
        if method == "dspark" and k > self.config.dspark_block_size:
            raise FieldError("speculative_config", f"speculative_config: num_speculative_tokens={k} exceeds the "
                             f"DSpark drafter's block of {self.config.dspark_block_size} tokens (dspark_block_size)")

    # ---- inputs ----
    def _check_ids(self, ids: Sequence[int], what: str = "prompt") -> list[int]:
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise TypeError(f"{what} must be a string or a list of token ids, got {type(ids).__name__}")
        # the common case (plain ints) in passes at C speed: the element-wise checks took ~100 ms of a 128K-token
        # prompt's generate on this project's CPU machine
        if set(map(type, ids)) <= {int}:
            ids = list(ids)
        else:
            bad = [t for t in ids if not isinstance(t, (int, np.integer)) or isinstance(t, (bool, np.bool_))]
            if bad:
                raise TypeError(f"{what}: token ids must be integers, got {bad[:5]!r}")
            ids = [int(t) for t in ids]
        check_prompt_ids(ids, self.config.vocab_size, what)
        return ids

    def encode(self, prompt: str | Sequence[int], what: str = "prompt") -> list[int]:
        """Token ids of a prompt: a string is tokenized (BOS added when the tokenizer's config asks for it), a
        list of token ids is checked against the vocabulary. An empty prompt is an error."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{what} is a string but this model has no tokenizer: pass prompts as lists "
                                 "of token ids")
            if not prompt:
                raise ValueError(f"{what} is empty")
            return self._check_ids(self.tokenizer.encode(prompt).ids, what)
        return self._check_ids(prompt, what)

    def decode(self, ids: Sequence[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ---- teacher-forced forward ----
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Full-sequence forward, no cache: float32 [T, vocab]."""
        ids = self._check_ids(token_ids)
        if len(ids) > self.max_model_len:
            raise ValueError(f"{len(ids)} tokens exceed the context limit of {self.max_model_len}")
        t = len(ids)
        padded = np.zeros((1, _bucket(t)), np.int32)  # right padding cannot change earlier positions (causal)
        padded[0, :t] = ids
        return np.asarray(self._forward(self._state, jnp.asarray(padded)))[0, :t].astype(np.float32)

    def prompt_logprobs(self, token_ids: Sequence[int], top_n: int = 0) -> PromptLogprobs:
        """Each token's log-prob given the tokens before it, and the top_n most likely tokens at each position
        (0..MAX_TOP_LOGPROBS), from one teacher-forced forward (as `logits`): what OpenAI's `echo` with
        `logprobs` returns for a prompt, and what evaluation harnesses score continuations with."""
        ids = self._check_ids(token_ids)
        top_n = check_field("top_logprobs", top_n, field="top_n")
        if len(ids) > self.max_model_len:
            raise ValueError(f"{len(ids)} tokens exceed the context limit of {self.max_model_len}")
        t = len(ids)
        padded = np.zeros((1, _bucket(t)), np.int32)  # right padding cannot change earlier positions (causal)
        padded[0, :t] = ids
        # one program per length bucket with or without alternatives (their count is sliced on the host)
        n_top = MAX_TOP_LOGPROBS if top_n else 0
        chosen, (top_lps, top_ids) = jax.device_get(self._score(self._state, jnp.asarray(padded), n_top))
        chosen = chosen[:t - 1].tolist()
        if not top_n:
            return PromptLogprobs([None] + chosen, [None] + [[] for _ in chosen])
        ids_l, lps_l = top_ids[:t - 1, :top_n].tolist(), top_lps[:t - 1, :top_n].tolist()
        return PromptLogprobs([None] + chosen, [None] + [list(zip(i, lp)) for i, lp in zip(ids_l, lps_l)])

    # ---- generation ----
    @property
    def engine(self):
        """The engine, built on first use (by generate, or the server): its pools must fit what is free first."""
        if self._engine is None:
            with self._cond:  # once, whichever thread comes first
                if self._engine is None:
                    from v4jax.engine import EngineCore
                    from v4jax.memory import budget_for_utilization, check_engine_fits, model_weight_bytes
                    if self.options.gpu_memory_utilization is not None:
                        budget = budget_for_utilization(self.config, self.options, self.max_model_len, self.dtype,
                                                        model_weight_bytes(self.model))
                        self.options = dataclasses.replace(self.options, gpu_memory_utilization=None,
                                                           memory_budget_bytes=budget)
                    first = self._first_compile()
                    first.before()  # building the engine compiles too (its pools), then its first steps
                    check_engine_fits(self.config, self.options, self.max_model_len, self.dtype,
                                      weight_bytes=model_weight_bytes(self.model))
                    engine = EngineCore(self.config, self.model, self.options, self.run_options, self.max_model_len)
                    engine.compile_hooks = first.hooks()
                    self._engine = engine
        return self._engine

    def warmup(self, progress=None, *, cover_only: bool = True) -> int:
        """Compile the engine's step programs now rather than at the first requests of each shape (`cover_only`: the
        few that cover every step, the rest compiling in the background when first needed; False: all of them;
        EngineCore.warmup), then check that the largest one's temporaries fit the device memory left after the
        weights and pools: a DeviceMemoryError naming what to lower, where serving would run out of memory at the
        first step of that shape. `progress(done, total)` after each program. Returns the programs compiled."""
        from v4jax import memory as M
        engine = self.engine
        n = engine.warmup(progress, cover_only=cover_only)
        pools = M.engine_pools(self.config, self.options, self.max_model_len, self.dtype)
        free, source = M.device_free_bytes(in_use=M.model_weight_bytes(self.model) + pools.per_device)
        M.check_step_temporaries({str(p): b for p, b in engine.step_temporaries.items()}, free=free, source=source,
                                 pools=pools)
        return n

    def _first_compile(self):
        """The one-line notice before the engine is built and its first steps compile what the cache does not hold
        yet, keyed on everything its programs depend on."""
        from v4jax import compile_cache
        devices = [(d.platform, d.device_kind) for d in jax.devices()]
        signature = repr((jax.__version__, devices, self.config, self.dtype, self.options, self.max_model_len,
                          self.run_options.attention_impl, self.run_options.quant_sim))
        return compile_cache.FirstCompile(signature)

    @property
    def request_check(self) -> RequestCheck:
        """The engine's request check (v4jax.engine.checks), from the layout it has or would build."""
        if self._engine is not None:
            return self._engine.request_check
        if self._check is None:
            mesh_shape = None if self.mesh_rules is None else dict(self.mesh_rules.mesh.shape)
            self._check = RequestCheck.for_options(self.config, self.options, self.model.dtype, self.max_model_len,
                                                   mesh_shape)
        return self._check

    @staticmethod
    def _check_requests(prompts, sampling) -> tuple[list, list[SamplingParams]]:
        """(prompt list, one SamplingParams per prompt) from generate's arguments, or a TypeError / ValueError
        saying what they must be."""
        if isinstance(prompts, np.ndarray):
            prompts = prompts.tolist()
        if isinstance(prompts, str):
            plist = [prompts]
        elif isinstance(prompts, Sequence) and not isinstance(prompts, bytes):
            single = len(prompts) > 0 and all(isinstance(t, (int, np.integer)) for t in prompts)
            plist = [list(prompts)] if single else list(prompts)
        else:
            raise TypeError("prompts must be a string, a list of token ids, or a list of strings / token-id lists; "
                            f"got {type(prompts).__name__}")
        for i, p in enumerate(plist):
            if isinstance(p, np.ndarray):
                plist[i] = p = p.tolist()
            if not isinstance(p, (str, Sequence)) or isinstance(p, bytes):
                raise TypeError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}")
        if sampling is None:
            params = [SamplingParams()] * len(plist)
        elif isinstance(sampling, SamplingParams):
            params = [sampling] * len(plist)
        elif isinstance(sampling, (list, tuple)):
            params = list(sampling)
            bad = [type(sp).__name__ for sp in params if not isinstance(sp, SamplingParams)]
            if bad:
                raise TypeError(f"sampling must be a SamplingParams or a list of them; the list holds {bad[0]}")
            if len(params) != len(plist):
                raise ValueError(f"{len(params)} sampling params for {len(plist)} prompts")
        else:
            raise TypeError(f"sampling must be a SamplingParams, a list of them, or None; got "
                            f"{type(sampling).__name__}")
        return plist, params

    def generate(self, prompts, sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 stream: bool = False):
        """Generate for one prompt or a list of prompts (strings or token-id lists). Returns a list of
        RequestOutput, or with stream=True an iterator of (prompt_index, new_token_ids, new_text) events.

        Calls share one engine: streams may be read interleaved, other calls made inside a stream's loop, and
        calls come from several threads, each getting exactly its own events. A stream closed or dropped before
        its end, and a call that raises (Ctrl-C: once the engine step running has ended), abort their requests."""
        plist, params = self._check_requests(prompts, sampling)
        if not plist:
            return iter(()) if stream else []
        try:
            ids = [self.encode(p, f"prompt {i}") for i, p in enumerate(plist)]
        except RequestError:  # empty, or ids outside the vocabulary: the request check's rules
            self._rejected += 1
            raise
        check = self.request_check
        for i, (p, sp) in enumerate(zip(ids, params)):
            try:
                check.check_size(len(p), sp)  # the ids were checked by encode
            except RequestError as e:
                self._rejected += 1
                raise RequestError(f"prompt {i}: {e.message}", e.param, e.code) from None
        call = self._submit(ids, params)
        if stream:
            events = self._stream(call, len(ids))
            # a stream never started, or dropped without close(), is garbage: its requests end with it
            weakref.finalize(events, self._drop, call).atexit = False
            return events
        outs = [RequestOutput(p, [], None, [] if sp.logprobs else None, "length",
                              [] if sp.top_logprobs else None) for p, sp in zip(ids, params)]
        with contextlib.closing(self._events(call)) as events:  # an error or Ctrl-C here aborts what is left
            for ev in events:
                out = outs[ev.request_index]
                out.token_ids.extend(ev.token_ids)
                if out.logprobs is not None:
                    out.logprobs.extend(ev.logprobs)
                if out.top_logprobs is not None:
                    out.top_logprobs.extend(ev.top_logprobs)
                if ev.finish_reason is not None:
                    out.finish_reason = ev.finish_reason
        for out in outs:
            out.text = self.decode(out.token_ids)
        return outs

    def _submit(self, ids: list[list[int]], params: list[SamplingParams]) -> _Call:
        """Add every prompt to the engine (all or none: a rejected one withdraws those already added)."""
        core, call = self.engine, _Call()
        with self._cond:
            self._cond.wait_for(lambda: not self._stepping)
            try:
                for i, (p, sp) in enumerate(zip(ids, params)):
                    rid = core.new_request_id()
                    core.add_request(rid, p, sp, sample_index=i)
                    call.index[rid] = i
                    self._owners[rid] = call
            except BaseException:
                self._dropped.append(call)  # those already added are withdrawn
                raise
            finally:
                self._abort_dropped()
        return call

    def _events(self, call: _Call) -> Iterator[_Event]:
        """The call's events until each of its requests has finished, stepping the engine when the inbox is empty.
        A consumer that stops early (closes it, or drops it) aborts what is left, and every page comes back."""
        n_open = len(call.index)
        try:
            while n_open:
                if not call.inbox:
                    self._step_for(call)
                    continue
                ev = call.inbox.popleft()
                n_open -= ev.finish_reason is not None
                yield ev
        finally:
            if n_open:
                self._drop(call)

    def _step_for(self, call: _Call) -> None:
        """Step the engine once, or wait while another thread steps it, until the call's inbox has events. Each
        delta goes to the call that owns its request: another call's events wait in its inbox until it reads them
        (an interleaved stream, a generate inside a stream's loop, another thread)."""
        with self._cond:
            self._cond.wait_for(lambda: call.inbox or not self._stepping)
            if call.inbox:
                return
            self._stepping = True
        deltas = []
        with _ctrl_c_after_step():
            try:
                deltas = self._engine.step()
            finally:
                with self._cond:
                    self._stepping = False
                    for d in deltas:
                        owner = self._owners.get(d.request_id)
                        if owner is None:
                            continue  # a dropped call's
                        if d.finish_reason is not None:
                            del self._owners[d.request_id]
                        owner.inbox.append(_Event(owner.index[d.request_id], d.new_token_ids, d.new_logprobs,
                                                  d.finish_reason, d.new_top_logprobs))
                    self._abort_dropped()
                    self._cond.notify_all()

    def _drop(self, call: _Call) -> None:
        """Abort the call's unfinished requests: now when the engine is idle, else when the step running ends. It
        may run inside a step (a finalizer run by a garbage collection), so it never waits for the lock."""
        self._dropped.append(call)
        if self._cond.acquire(blocking=False):
            try:
                if not self._stepping:
                    self._abort_dropped()
            finally:
                self._cond.release()

    def _abort_dropped(self) -> None:
        """(Under the lock, between steps.) Abort the requests of dropped calls that have not finished."""
        while self._dropped:
            for rid in self._dropped.popleft().index:
                if self._owners.pop(rid, None) is not None:
                    self._engine.abort(rid)

    def stats(self) -> dict:
        """Pools (used / total pages), prefix cache (queried and hit tokens), request counts (`rejected`: by
        the request check, in generate or at the engine), the engine's steps (`steps`: how many, their wall seconds
        and the part spent waiting on the device) and the weights' bytes (`bytes`, and `by_format`: "fp8", "fp4"
        values with their scales, other arrays by dtype)."""
        from v4jax import memory as M
        core = self.engine
        with self._cond:
            self._cond.wait_for(lambda: not self._stepping)
            self._abort_dropped()
            st = core.stats()
        st["requests"]["rejected"] += self._rejected
        st["weights"] = M.weight_stats(self.model)
        return st

    def _stream(self, call: _Call, n_prompts: int) -> Iterator[tuple[int, list[int], str | None]]:
        # text in O(new tokens) per event (decoding each request's whole output per event was quadratic: ~11 s of
        # host time over a 32K-token stream); a partial UTF-8 sequence is held back until its last byte arrives
        detok = {i: IncrementalDetokenizer(self.decode) for i in range(n_prompts)} if self.tokenizer else None
        with contextlib.closing(self._events(call)) as events:  # closing the stream aborts what is left
            for ev in events:
                new_text = None
                if detok is not None:
                    d = detok[ev.request_index]
                    new_text = "".join(d.push(t) for t in ev.token_ids)
                    if ev.finish_reason is not None:
                        new_text += d.flush()
                if ev.token_ids or new_text:
                    yield ev.request_index, list(ev.token_ids), new_text
