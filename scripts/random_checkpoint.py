"""A checkpoint of another's architecture with random weights (the model's own init, seed N), its tokenizer
copied: what a trained model's behaviour is compared against (BENCHMARKS, the offload's hit rates).

    python scripts/random_checkpoint.py v4jax/default_model /tmp/random_default [--seed 0]
"""
import argparse
import os
import shutil


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("like", help="checkpoint directory whose config.json (and tokenizer) to take")
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    import jax.numpy as jnp
    from flax import nnx

    from checkpoints import write_official_checkpoint
    from v4jax import LLM
    from v4jax.model import Transformer
    from v4jax.model.weights import model_to_official
    cfg = LLM(a.like, dtype="float32").config
    os.makedirs(a.out, exist_ok=True)
    model = Transformer(cfg, rngs=nnx.Rngs(a.seed), dtype=jnp.float32)
    write_official_checkpoint(a.out, cfg, model_to_official(model), fp8=False, fp4_experts=False, bf16=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(a.like, name)):
            shutil.copy(os.path.join(a.like, name), a.out)


if __name__ == "__main__":
    main()
