"""`v4jax generate | bench | memory` on the command line."""
from __future__ import annotations

import argparse
import sys
import warnings


def _generate(argv):
    ap = argparse.ArgumentParser(prog="v4jax generate", description="Generate text with a V4 model.")
    ap.add_argument("prompts", nargs="*", default=["ROMEO:"], help="prompts (default: 'ROMEO:')")
    ap.add_argument("--model", default=None, help="HF-format directory or preset (default: the embedded model)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--no-stream", action="store_true", help="print each result at the end")
    ap.add_argument("--attention-impl", default="xla", choices=["xla", "pallas"])
    args = ap.parse_args(argv)

    from v4jax import LLM, SamplingParams
    llm = LLM(args.model, dtype=args.dtype, attention_impl=args.attention_impl)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                        top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    prompts = args.prompts
    if llm.tokenizer is None:
        # A random preset has no tokenizer: feed the prompt's UTF-8 bytes as token ids.
        print(f"[{llm.source} has no tokenizer: prompt bytes are the token ids]", file=sys.stderr)
        prompts = [[b % llm.config.vocab_size for b in p.encode()] for p in args.prompts]
    if args.no_stream or len(prompts) > 1:
        for p, out in zip(args.prompts, llm.generate(prompts, sp)):
            body = out.text if out.text is not None else " ".join(map(str, out.token_ids))
            print(f"{p}{body}\n[{out.finish_reason}, {len(out.token_ids)} tokens]\n")
        return 0
    print(args.prompts[0], end="", flush=True)
    for _, toks, text in llm.generate(prompts, sp, stream=True):
        print(text if text is not None else " " + " ".join(map(str, toks)), end="", flush=True)
    print()
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmds = {"generate": _generate, "bench": _bench, "memory": _memory}
    if not argv or argv[0] not in cmds:
        print("usage: v4jax {generate,bench,memory} ...", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore", message=".*random weights.*")
    return cmds[argv[0]](argv[1:]) or 0


def _bench(argv):
    if not argv or argv[0] not in ("decode", "kernels"):
        print("usage: v4jax bench {decode,kernels} ...", file=sys.stderr)
        return 2
    if argv[0] == "decode":
        from v4jax.bench import decode_main
        return decode_main(argv[1:])
    from pallas_kernels.bench import main as kernels_main
    return kernels_main(argv[1:])


def _memory(argv):
    from v4jax.bench import memory_main
    return memory_main(argv)


if __name__ == "__main__":
    sys.exit(main())
