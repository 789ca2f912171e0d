"""Options of `v4jax serve`: the server's own, and every `LLM` option as a flag (kept light: no server imports)."""
from __future__ import annotations

import argparse
import dataclasses
import json


@dataclasses.dataclass
class ServerOptions:
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = None  # when set, /v1/* (but /v1/health) needs "Authorization: Bearer <key>"
    served_model_name: str | None = None  # default: the directory's base name, the preset's name, or
    # v4jax-shakespeare for the embedded model
    max_waiting: int = 256  # sequences waiting for a decode slot; more get 429
    max_n: int = 16  # largest n (choices per request)
    request_timeout_s: float = 600.0  # a request still running after this is aborted (408)
    max_body_bytes: int = 8 << 20  # larger request bodies get 413
    shutdown_grace_s: float = 5.0  # on SIGINT / SIGTERM: time running requests get to finish before they are
    # aborted (their streams end early, with OpenAI's finish_reason "length")
    log_level: str = "info"
    access_log: bool = True
    # prefill/decode disaggregation (v4jax.serve.disagg): None (a combined server), "prefill" or "decode"
    disaggregation_mode: str | None = None
    pd_secret: str | None = None  # when set, the servers' PD routes (and a PD server's /v1/*) need it in the
    # x-v4jax-pd-secret header: only the router and the other servers know it
    pd_transport: str = "jax"  # how state bytes move: jax.experimental.transfer ("jax") or HTTP ("http")
    pd_offer_timeout_s: float = 60.0  # a prefill server withdraws an offered state nobody pulled within this

    def __post_init__(self):
        if self.disaggregation_mode not in (None, "prefill", "decode"):
            raise ValueError(f"disaggregation_mode must be 'prefill' or 'decode', got {self.disaggregation_mode!r}")
        if self.pd_transport not in ("jax", "http"):
            raise ValueError(f"pd_transport must be 'jax' or 'http', got {self.pd_transport!r}")
        for name in ("max_waiting",):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("max_n", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("request_timeout_s", "shutdown_grace_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")
        if not self.pd_offer_timeout_s > 0:
            raise ValueError("pd_offer_timeout_s must be > 0")


_LLM_HELP = {
    "quant_sim": "the release's FP8-KV / FP4-indexer / FP8-activation rounding",
    "kv_cache_dtype": "KV pools' storage: the model's dtype (auto), bfloat16, or the release's FP8 entries and FP4 "
                      "indexer keys (fp8)",
    "attention_impl": "kernels: the XLA references or the Pallas kernels (default: pallas on a GPU, else xla)",
    "quantization": "weights: as the checkpoint stores them (default; a preset's in --dtype), 'none' dequantized to "
                    "--dtype, 'fp8' the release's FP8 linears and FP4 experts",
    "seed": "weights of a random preset",
    "max_model_len": "context limit, prompt + generated tokens (default: the model's)",
    "max_num_seqs": "decode slots",
    "kv_layout": "KV-cache layout",
    "page_size": "tokens per full page (default: 256 rounded up to the lcm of the compression ratios)",
    "decode_steps": "tokens per jitted decode call",
    "prefill_chunk": "largest prefill chunk, in tokens",
    "memory_budget_bytes": "size the KV pools from this byte budget instead of max_num_seqs x max_model_len",
    "gpu_memory_utilization": "share of each device's memory for the weights and KV pools (0-1, as vLLM's): the "
                              "pools get what the weights leave of it",
    "enable_prefix_caching": "reuse cached full pages of earlier requests' prefixes",
    "mesh": "devices per mesh axis, e.g. expert=4 or data=2,tensor=2 (default: one device)",
    "enable_hisparse": "keep the C4 KV pool in host memory with a device buffer of hot entries (HiSparse)",
    "hisparse_device_pages": "the device buffer's size in pages of C4 entries (default: four decode steps' selections)",
    "speculative_config": "speculative decoding as JSON, e.g. '{\"method\": \"mtp\", \"num_speculative_tokens\": 3}' "
                          "(method \"dspark\": the DSpark drafter of the 0731 / -DSpark releases)",
}
_CHOICES = {"attention_impl": ["xla", "pallas"], "kv_layout": ["paged", "dense"], "quantization": ["none", "fp8"],
            "kv_cache_dtype": ["auto", "bfloat16", "fp8"]}


def json_object(text: str) -> dict:
    """A flag's JSON object (argparse reports the ValueError as a bad value)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object: {text!r}")
    return value


def add_llm_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per EngineOptions field (its name with dashes), plus --dtype: what LLM(...) takes."""
    from v4jax.api import EngineOptions
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights and compute dtype")
    for f in dataclasses.fields(EngineOptions):
        flag = "--" + f.name.replace("_", "-")
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        helptext = _LLM_HELP.get(f.name, f.name)
        if kind.startswith("bool"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=helptext)
        elif kind.startswith("int"):
            p.add_argument(flag, type=int, default=f.default, help=helptext)
        elif kind.startswith("float"):
            p.add_argument(flag, type=float, default=f.default, help=helptext)
        elif kind.startswith("dict"):
            p.add_argument(flag, type=json_object, default=f.default, metavar="JSON", help=helptext)
        else:
            p.add_argument(flag, default=f.default, choices=_CHOICES.get(f.name), help=helptext)


def llm_kwargs(args) -> dict:
    from v4jax.api import EngineOptions
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineOptions)}
    return {"dtype": args.dtype, **kw}


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    d = ServerOptions()
    p.add_argument("--host", default=d.host, help="address to bind (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=d.port, help="port to bind")
    p.add_argument("--api-key", default=d.api_key, help="require 'Authorization: Bearer KEY' on /v1/* "
                   "(default: no key)")
    p.add_argument("--served-model-name", default=d.served_model_name,
                   help="model id in /v1/models (default: the directory's base name or the preset's name)")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help="sequences that may wait for a decode slot; more are refused with 429")
    p.add_argument("--max-n", type=int, default=d.max_n, help="largest n (choices per request)")
    p.add_argument("--request-timeout", dest="request_timeout_s", type=float, default=d.request_timeout_s,
                   help="seconds a request may run before it is aborted (408)")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="larger bodies get 413")
    p.add_argument("--shutdown-grace", dest="shutdown_grace_s", type=float, default=d.shutdown_grace_s,
                   help="on SIGINT / SIGTERM, seconds running requests get to finish before they are aborted")
    p.add_argument("--log-level", default=d.log_level, choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=d.access_log,
                   help="a log line per HTTP request")
    p.add_argument("--disaggregation-mode", default=d.disaggregation_mode, choices=["prefill", "decode"],
                   help="prefill/decode disaggregation: this server prefills for decode servers (prefill), or "
                   "decodes requests a `v4jax router` sends, prefilled on the prefill servers it names (decode)")
    p.add_argument("--pd-secret", default=d.pd_secret, help="shared secret of the router and the PD servers "
                   "(header x-v4jax-pd-secret; default: none)")
    p.add_argument("--pd-transport", default=d.pd_transport, choices=["jax", "http"],
                   help="how a request's state moves: jax.experimental.transfer, or the bytes over HTTP")
    p.add_argument("--pd-offer-timeout", dest="pd_offer_timeout_s", type=float, default=d.pd_offer_timeout_s,
                   help="a prefill server drops a request's exported state that no decode server pulled within "
                   "this many seconds (logged; v4jax_pd_offers_withdrawn_total)")
    p.add_argument("--warmup", default="cover", choices=["cover", "all", "none"],
                   help="compile before answering (a progress bar): cover (default), the few programs that can run "
                   "every step (a step whose own program is missing runs on one while its own compiles in the "
                   "background: no request waits for the compiler); all, every program (long: flash-slice on an "
                   "H200 took ~5.6 s a program at 8 threads, and a 16K context with 32 slots has ~200); none, the "
                   "first requests of each shape compile. The persistent compilation cache keeps them for the next "
                   "start")


def server_options(args) -> ServerOptions:
    names = [f.name for f in dataclasses.fields(ServerOptions)]
    return ServerOptions(**{n: getattr(args, n) for n in names})
