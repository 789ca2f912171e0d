"""The `v4jax` command line: generate, serve, bench decode / kernels / replay / serve, memory.

`v4jax` alone (or `v4jax bench` alone) prints the help and exits 0. Errors in the arguments exit 2 with
argparse's usage message; errors of the user's making found later (a model directory that is missing or
corrupt, a prompt longer than the context, a model too big for the device...) print one line `error: ...` and
exit 1; `--debug` shows the traceback instead. Ctrl-C in `generate` aborts what is running and exits 130.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import textwrap
import warnings

EPILOG = """examples:
  v4jax generate "ROMEO:"                              the embedded Shakespeare model, streamed
  v4jax generate "To be, or not" --temperature 0.8 --seed 0 --max-tokens 64
  v4jax generate --model tiny "x"                     a random preset (no tokenizer: prompt bytes are token ids)
  v4jax memory --model flash --mesh expert=8          weights and KV pools per device
  v4jax convert HF_DIR OUT --mesh expert=8           an orbax checkpoint, restorable onto any mesh
  v4jax bench decode --small                          the decode benchmark (its own flags: bench decode -h)
  v4jax bench kernels --small                         the kernel benchmark (its own flags: bench kernels -h)
  v4jax bench replay                                  prefix-cache replay traces (its own flags: bench replay -h)
  v4jax serve --port 8000                             OpenAI-compatible server of the embedded model
  v4jax router --prefill URL --decode URL             one endpoint over prefill and decode servers
  v4jax bench serve --rate 4 --num-requests 64        load generator against a running server
"""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each flag's help; an option whose default is None says what None means itself."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False and action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def _version() -> str:
    from importlib import metadata
    try:
        return metadata.version("v4jax")
    except metadata.PackageNotFoundError:
        pass
    try:  # a source checkout that was not installed: the version in pyproject.toml
        import tomllib
        with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml"),
                  "rb") as f:
            return tomllib.load(f)["project"]["version"]
    except (OSError, KeyError, ValueError):
        return "unknown"


def _int_list(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _model_help() -> str:
    from v4jax.config import PRESETS
    return (f"an HF-format checkpoint directory or a preset ({', '.join(PRESETS)}: random weights); default: the "
            "embedded Shakespeare model")


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _tokens(s: str) -> int:
    """1048576, 64K, 1M -> tokens (K = 1024)."""
    t = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(t[-1:], 1)
    try:
        v = int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count such as 4096, 64K or 1M, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {s!r}")
    return v


def _wrap(text: str) -> str:
    return textwrap.fill(text, 100)


def build_parser() -> argparse.ArgumentParser:
    from v4jax.engine.sampling import SamplingParams
    from v4jax.serve.options import json_object
    sp = SamplingParams()
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of an error")

    ap = argparse.ArgumentParser(prog="v4jax", formatter_class=_Formatter, parents=[common], epilog=EPILOG,
                                 description="A JAX/XLA inference stack for DeepSeek-V4-class models.")
    ap.add_argument("--version", action="version", version=f"v4jax {_version()}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    model_help = _model_help()

    g = sub.add_parser("generate", parents=[common], formatter_class=_Formatter,
                       help="generate text with a model", description=_wrap(
                           "Generate a continuation of each prompt. One prompt is streamed as it is generated; "
                           "several are generated together and printed at the end. Sampling defaults are "
                           "SamplingParams' (vLLM's): temperature 0 is greedy."))
    g.add_argument("prompts", nargs="*", default=["ROMEO:"], metavar="PROMPT", help="prompt strings")
    g.add_argument("--model", default=None, help=model_help)
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights and compute dtype")
    g.add_argument("--max-tokens", type=_positive_int, default=sp.max_tokens,
                   help="tokens to generate per prompt (at most)")
    g.add_argument("--temperature", type=float, default=sp.temperature, help="sampling temperature; 0 = greedy")
    g.add_argument("--top-p", type=float, default=sp.top_p, help="nucleus sampling mass in (0, 1]; 1 = off")
    g.add_argument("--top-k", type=int, default=sp.top_k, help="sample among the k most likely tokens; 0 = off")
    g.add_argument("--min-p", type=float, default=sp.min_p, help="never sample a token less likely than this "
                   "fraction of the most likely one; 0 = off")
    g.add_argument("--seed", type=int, default=sp.seed, help="sampling seed (default: a fresh random seed)")
    g.add_argument("--stop-token-ids", type=_int_list, default=None, metavar="IDS",
                   help="comma-separated token ids that end a request (default: none; EOS always does)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")
    g.add_argument("--min-tokens", type=int, default=sp.min_tokens,
                   help="tokens generated before EOS or a stop token id may end a request; 0 = off")
    g.add_argument("--presence-penalty", type=float, default=sp.presence_penalty,
                   help="subtracted from the logit of each token the output holds, in [-2, 2]; 0 = off")
    g.add_argument("--frequency-penalty", type=float, default=sp.frequency_penalty,
                   help="times each token's count in the output, subtracted from its logit, in [-2, 2]; 0 = off")
    g.add_argument("--repetition-penalty", type=float, default=sp.repetition_penalty,
                   help="divides the positive logits of the prompt's and the output's tokens (multiplies the "
                   "negative ones), in (0, 2]; 1 = off")
    g.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="context limit, prompt + generated tokens (default: the model's)")
    g.add_argument("--attention-impl", default=None, choices=["xla", "pallas"],
                   help="kernels: the XLA references or the Pallas kernels (default: pallas on a GPU, else xla)")
    g.add_argument("--mesh", default=None, help="devices per mesh axis over every process's devices, e.g. "
                   "tensor=8 or data=2,tensor=2,expert=2 (default: one device)")
    g.add_argument("--coordinator-address", default=None, help="multi-host: process 0's host:port (default: "
                   "$V4JAX_COORDINATOR_ADDRESS, a LeaderWorkerSet's leader, or what a TPU pod / SLURM job says)")
    g.add_argument("--num-processes", type=_positive_int, default=None, help="multi-host: processes in the job")
    g.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")
    g.add_argument("--speculative-config", type=json_object, default=None, metavar="JSON",
                   help="speculative decoding with the model's MTP block or DSpark drafter, e.g. "
                   "'{\"method\": \"mtp\", \"num_speculative_tokens\": 3}' or "
                   "'{\"method\": \"dspark\", \"num_speculative_tokens\": 5}'")
    g.add_argument("--enable-hisparse", action="store_true", help="keep the C4 KV pool in host memory with a "
                   "device buffer of hot entries (HiSparse)")
    g.add_argument("--hisparse-device-pages", type=_positive_int, default=None, help="the device buffer's size in "
                   "pages of C4 entries (default: four decode steps' selections)")
    g.add_argument("--no-stream", action="store_true", help="print each result at the end")
    g.set_defaults(func=_generate)

    from v4jax.serve.options import add_llm_arguments, add_server_arguments
    s = sub.add_parser("serve", parents=[common], formatter_class=_Formatter,
                       help="serve a model over HTTP (OpenAI API, JetStream /v1/generate, metrics)",
                       description=_wrap(
                           "Serve a model: POST /v1/completions and /v1/chat/completions (OpenAI, streamed or not), "
                           "GET /v1/models, JetStream's POST /v1/generate and GET /v1/health, GET /health, GET "
                           "/metrics (Prometheus). SIGINT / SIGTERM drain: running requests get --shutdown-grace "
                           "seconds, then their streams end."))
    s.add_argument("model", nargs="?", default=None, metavar="MODEL", help=model_help)
    add_server_arguments(s)
    add_llm_arguments(s)
    s.set_defaults(func=_serve)

    rt = sub.add_parser("router", parents=[common], formatter_class=_Formatter,
                        help="one OpenAI endpoint in front of prefill and decode servers (disaggregation)",
                        description=_wrap(
                            "Route OpenAI requests (/v1/completions, /v1/chat/completions, streamed or not) to "
                            "`v4jax serve --disaggregation-mode decode` servers, each request naming the "
                            "`--disaggregation-mode prefill` servers that prefill it (least loaded first). A server "
                            "that fails before the first token is retried once on another; then 503."))
    rt.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill servers")
    rt.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode servers")
    rt.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    rt.add_argument("--port", type=int, default=8000, help="port to bind")
    rt.add_argument("--pd-secret", default=None, help="the servers' shared secret (their --pd-secret)")
    rt.add_argument("--request-timeout", dest="request_timeout_s", type=float, default=600.0,
                    help="seconds a forwarded request may take")
    rt.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    rt.set_defaults(func=_router)

    b = sub.add_parser("bench", parents=[common], formatter_class=_Formatter,
                       help="benchmarks (decode, generate, kernels, mesh, pd, replay, serve, spec, startup, table, "
                            "tpu-aot, tpu-plan, gpu-launches)",
                       description="Benchmarks. Each subcommand has its own flags: `v4jax bench decode -h`.")
    bsub = b.add_subparsers(dest="bench", metavar="BENCHMARK", title="benchmarks")
    for name, text in (("decode", "decode step time and tokens/s against the roofline (v4jax.bench)"),
                       ("generate", ("what LLM.generate users see: compile, prefill against the FLOP roofline, "
                                     "decode ms/step (v4jax.bench.generate)")),
                       ("kernels", ("Pallas kernel timings against their jnp references, and their tile sweeps "
                                    "(--tune, --sweep NAME; v4jax.bench.kernels)")),
                       ("mesh", ("decode on device meshes against one device: same tokens, ms/step, scaling "
                                 "(v4jax.bench.mesh)")),
                       ("pd", ("one request's state between two engines: bytes by pool, export / transfer / "
                               "import times (v4jax.bench.pd)")),
                       ("replay", "request traces against dense / paged / paged + prefix cache (v4jax.bench.replay)"),
                       ("serve", "open-loop load against a running v4jax serve (v4jax.bench.serve)"),
                       ("spec", ("speculative decoding with the MTP block against plain decoding: ms/token, "
                                 "acceptance by draft position (v4jax.bench.spec)")),
                       ("startup", ("`v4jax serve` per --warmup mode: seconds to ready, then its first load's "
                                    "TTFT / ITL and the compiles it waited for (v4jax.bench.startup)")),
                       ("hisparse", ("long requests decoding with the C4 KV pool on the host or the device: capacity, "
                                     "ms/step, hit rate, bytes fetched per step (v4jax.bench.hisparse)")),
                       ("table", "one markdown table from decode.json / generate.json files (v4jax.bench.table)"),
                       ("tpu-aot", ("every Pallas TPU kernel and the engine's steps compiled for a TPU with libtpu on "
                                    "a CPU machine (v4jax.bench.tpu_aot)")),
                       ("tpu-plan", ("a preset's engine steps compiled for a TPU pod slice: memory per device "
                                     "(v4jax.bench.tpu_aot)")),
                       ("gpu-launches", ("the launches of a preset's decode step on an H100, counted from XLA:GPU's "
                                         "program compiled on a CPU machine (v4jax.bench.gpu_launches)"))):
        # Everything after the name, -h included, goes to the benchmark's own parser.
        p = bsub.add_parser(name, add_help=False, allow_abbrev=False, help=text, description=text)
        p.set_defaults(func=_bench, passthrough=True)
    b.set_defaults(func=lambda args: _help(b))

    m = sub.add_parser("memory", parents=[common], formatter_class=_Formatter,
                       help="weights and KV-pool bytes, per device", description=_wrap(
                           "Bytes of the KV pools per kind, per token and per request (bf16 and the FP8 / FP4 "
                           "layouts: --context, --requests, --format), the weights, and the pools an engine built "
                           "with the given LLM options allocates (the engine's own layout: exactly its bytes), in all "
                           "and on one device of the mesh: routed experts are split over the mesh's `expert` axis, "
                           "their width and the vocabulary over `tensor`, slots with their compressor state and SWA "
                           "pages over `data`, full pages of the KV pools over `data` x `context`; everything else "
                           "is counted on every device."))
    m.add_argument("--model", default="flash", help="preset name or HF-format directory (its config.json)")
    m.add_argument("--context", type=_tokens, default=1 << 20, help="tokens per request of the per-token report "
                   "(e.g. 4096, 64K, 1M)")
    m.add_argument("--requests", type=_positive_int, default=1, help="requests held at once (per-token report)")
    m.add_argument("--format", default="bf16,fp8,fp4", help="comma list of bf16, f32, fp8, fp4 pool layouts "
                   "(fp4 = FP8 KV + FP4 indexer keys)")
    m.add_argument("--budget-gib", type=float, default=None,
                   help="--memory-budget-bytes in GiB: the engine's pools sized to this budget (over the whole mesh)")
    m.add_argument("--json", action="store_true", help="print JSON instead of tables")
    add_llm_arguments(m)  # the engine's options, as LLM(...) takes them
    m.set_defaults(func=_memory)

    c = sub.add_parser("convert", parents=[common], formatter_class=_Formatter,
                       help="write an orbax checkpoint of a model, restorable onto any mesh", description=_wrap(
                           "Read an HF-format checkpoint directory (or a preset) into the shards of --mesh and "
                           "write it as an orbax checkpoint; LLM(OUT, mesh=...) restores it onto any mesh."))
    c.add_argument("source", metavar="HF_DIR", help="an HF-format checkpoint directory or a preset")
    c.add_argument("out", metavar="OUT", help="the orbax checkpoint directory to write")
    c.add_argument("--mesh", default=None, help="devices per mesh axis to load and write from, e.g. expert=8")
    c.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="parameter dtype")
    c.add_argument("--quantization", default=None, choices=["none", "fp8"], help="weights as the source stores them "
                   "(default), dequantized to --dtype (none), or the release's FP8 / FP4 formats (fp8)")
    c.set_defaults(func=_convert)
    ap.set_defaults(func=lambda args: _help(ap))
    return ap


def _help(parser) -> int:
    parser.print_help()
    return 0


def _one_line(e: BaseException) -> str:
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    return text or type(e).__name__


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and not getattr(args, "passthrough", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # --help, --version (0) and argument errors (2)
        return e.code if isinstance(e.code, int) else 0
    args.extra = [a for a in extra if a != "--debug"]
    debug = getattr(args, "debug", False) or "--debug" in extra
    from v4jax.config import ConfigError
    user_errors = (ValueError, OSError, ConfigError, KeyError, MemoryError)  # MemoryError: a step out of device memory
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*random weights.*")
            return args.func(args) or 0
    except SystemExit as e:  # a benchmark's own argparse (its -h, its argument errors)
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except user_errors as e:
        if debug:
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 1


# ---- commands ----------------------------------------------------------------------------------------------------
def _generate(args) -> int:
    from v4jax.config import PRESETS
    from v4jax.engine.sampling import SamplingParams

    # Everything that can be checked without the model is checked first: bad flags fail at once.
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop_token_ids=args.stop_token_ids or (),
                        ignore_eos=args.ignore_eos, min_tokens=args.min_tokens,
                        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                        repetition_penalty=args.repetition_penalty)
    if args.model is not None and args.model not in PRESETS and not os.path.isdir(args.model):
        raise FileNotFoundError(f"--model {args.model!r} is neither a checkpoint directory nor a preset "
                                f"({', '.join(sorted(PRESETS))})")
    if any(p == "" for p in args.prompts):
        raise ValueError("a prompt is empty")

    from sharding import multihost
    from v4jax import LLM
    multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)
    opts = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    if args.speculative_config is not None:
        opts["speculative_config"] = args.speculative_config
    if args.enable_hisparse:
        opts.update(enable_hisparse=True, hisparse_device_pages=args.hisparse_device_pages)
    llm = LLM(args.model, dtype=args.dtype, attention_impl=args.attention_impl, mesh=args.mesh, **opts)
    import jax
    if jax.process_index() != 0:  # every process generates the same; one prints
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the rest of the process)
    prompts = args.prompts
    if llm.tokenizer is None:
        # A random preset has no tokenizer: feed the prompt's UTF-8 bytes as token ids.
        print(f"[{llm.source} has no tokenizer: prompt bytes are the token ids]", file=sys.stderr)
        prompts = [[b % llm.config.vocab_size for b in p.encode()] for p in args.prompts]
    try:
        if args.no_stream or len(prompts) > 1:
            for p, out in zip(args.prompts, llm.generate(prompts, sp)):
                body = out.text if out.text is not None else " ".join(map(str, out.token_ids))
                print(f"{p}{body}\n[{out.finish_reason}, {len(out.token_ids)} tokens]\n")
            return 0
        print(args.prompts[0], end="", flush=True)
        try:
            with _ctrl_c_as_flag() as ctrl_c, contextlib.closing(llm.generate(prompts, sp, stream=True)) as events:
                for _, toks, text in events:
                    print(text if text is not None else " " + " ".join(map(str, toks)), end="", flush=True)
                    if ctrl_c:
                        raise KeyboardInterrupt  # here, between events: closing the stream aborts its request
        finally:
            print(flush=True)  # the streamed line ends, interrupted or not
        return 0
    except KeyboardInterrupt:
        # raised between engine steps (by LLM.generate, or the loop above) and the requests aborted, but the call
        # dispatched last still runs: wait for it, as the runtime torn down under a running computation can crash
        jax.block_until_ready(jax.live_arrays())
        raise  # main: "interrupted", exit 130


@contextlib.contextmanager
def _ctrl_c_as_flag():
    """A first Ctrl-C only fills the yielded list, for the caller to raise at a point of its choosing: raised
    wherever Python happens to be, a KeyboardInterrupt can land in JAX's garbage-collection callback, which
    swallows it (jax-ml/jax#18246; seen here during streams), or inside a dispatch. A second one raises at once."""
    import signal

    seen = []

    def on_sigint(signum, frame):
        if seen:
            raise KeyboardInterrupt
        seen.append(signum)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)


def _serve(args) -> int:
    from v4jax.config import PRESETS
    from v4jax.serve.options import llm_kwargs, server_options

    opts = server_options(args)  # bad server flags fail before the model loads
    if args.model is not None and args.model not in PRESETS and not os.path.isdir(args.model):
        raise FileNotFoundError(f"model {args.model!r} is neither a checkpoint directory nor a preset "
                                f"({', '.join(sorted(PRESETS))})")
    from v4jax import LLM
    from v4jax.serve import serve
    return serve(LLM(args.model, **llm_kwargs(args)), opts, warmup=args.warmup)


def _router(args) -> int:
    from v4jax.serve.router import RouterOptions, run_router
    return run_router(RouterOptions(prefill=args.prefill, decode=args.decode, host=args.host, port=args.port,
                                    pd_secret=args.pd_secret, request_timeout_s=args.request_timeout_s,
                                    log_level=args.log_level))


def _bench(args) -> int:
    import importlib
    module, func = BENCHMARKS[args.bench]
    return getattr(importlib.import_module(module), func)(args.extra)


# `v4jax bench NAME` -> (module, function of argv)
BENCHMARKS = {"decode": ("v4jax.bench.decode", "decode_main"), "generate": ("v4jax.bench.generate", "generate_main"),
              "kernels": ("v4jax.bench.kernels_cli", "main"), "mesh": ("v4jax.bench.mesh", "main"),
              "replay": ("v4jax.bench.replay", "main"), "serve": ("v4jax.bench.serve", "main"),
              "pd": ("v4jax.bench.pd", "main"), "hisparse": ("v4jax.bench.hisparse", "main"),
              "spec": ("v4jax.bench.spec", "spec_main"), "startup": ("v4jax.bench.startup", "main"),
              "table": ("v4jax.bench.table", "main"), "tpu-aot": ("v4jax.bench.tpu_aot", "aot_main"),
              "tpu-plan": ("v4jax.bench.tpu_aot", "plan_main"),
              "gpu-launches": ("v4jax.bench.gpu_launches", "main")}


def _convert(args) -> int:
    from v4jax.api import convert
    convert(args.source, args.out, dtype=args.dtype, mesh=args.mesh, quantization=args.quantization)
    print(f"wrote {args.out}")
    return 0


def _memory(args) -> int:
    import dataclasses
    import json

    from sharding.rules import parse_mesh_spec
    from v4jax import memory as M
    from v4jax.api import EngineOptions
    from v4jax.config import PRESETS, preset
    from v4jax.serve.options import llm_kwargs

    kw = llm_kwargs(args)
    dtype = kw.pop("dtype")
    if args.budget_gib is not None:
        if kw["memory_budget_bytes"] is not None:
            raise ValueError("give --budget-gib or --memory-budget-bytes, not both")
        kw["memory_budget_bytes"] = int(args.budget_gib * M.GiB)
    options = EngineOptions(**kw)
    mesh = parse_mesh_spec(options.mesh)
    if args.model in PRESETS:
        cfg = preset(args.model)
    elif os.path.isdir(args.model) or os.path.isfile(args.model):
        from v4jax.api import _read_config
        cfg = _read_config(args.model)
    else:
        raise FileNotFoundError(f"--model {args.model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
                                "directory with a config.json")
    n_dev = 1
    for v in mesh.values():
        n_dev *= v
    fmts = [f.strip() for f in args.format.split(",") if f.strip()]
    reps = [M.report(cfg, args.context, args.requests, f) for f in fmts]
    wdt = 2 if dtype == "bfloat16" else 4
    wfmt = M.report_weight_format(cfg, args.model if args.model not in PRESETS else None, options.quantization)
    weights = M.param_bytes(cfg, wdt, weights=wfmt)["total"]
    w_dev = M.weight_bytes_on_mesh(cfg, mesh, wdt, wfmt)
    # the engine's pools for these options (LLM's max_model_len: the option, at most the model's)
    max_model_len = min(options.max_model_len or cfg.max_seq_len, cfg.max_seq_len)
    pools = M.engine_pools(cfg, options, max_model_len, dtype)
    limit, source = M.device_memory_bytes()
    if args.json:
        out = {"model": args.model, "mesh": mesh, "reports": [dataclasses.asdict(r) for r in reps],
               "weights": {"dtype": dtype, "format": {"linear": wfmt.linear, "experts": wfmt.experts},
                           "total": weights, "per_device": w_dev},
               "engine_pools": pools.as_dict(), "device_memory": {"bytes": limit, "source": source}}
        print(json.dumps(out, indent=1))
        return 0
    print(M.format_report(reps, title=f"## {args.model}: {args.requests} request(s) x {args.context} tokens"))
    print()
    mesh_s = ",".join(f"{k}={v}" for k, v in mesh.items() if v > 1) or "one device"
    held = (f"as the release stores them (FP8 linears: {wfmt.linear}, routed experts: {wfmt.experts}, the rest "
            f"{dtype})" if wfmt.quantized else None)
    print(M.format_device_table(weights, w_dev, pools, mesh_s, n_dev, dtype, limit, source, held))
    return 0


if __name__ == "__main__":
    sys.exit(main())
