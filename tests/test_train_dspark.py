"""The DSpark drafter trainer (v4jax/training/dspark.py) on a tiny target: only the draft layers learn, the loss
falls, and what it writes loads as a checkpoint in the 0731 layout with the drafter it trained."""
from __future__ import annotations

import warnings

import numpy as np

from v4jax import LLM
from v4jax.model.weights import model_to_official
from v4jax.training.data import batches
from v4jax.training.dspark import DrafterTrainer, drafter_config, with_drafter, write
from v4jax.training.train import synthetic_tokens


def _quiet(fn, *a, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **kw)


def test_drafter_learns_and_the_target_stays(tmp_path):
    target = _quiet(LLM, "tiny", dtype="float32").model
    cfg = drafter_config(target.cfg, stages=1, block=3, rank=16)
    model = with_drafter(target, cfg, seed=1)
    before = model_to_official(model)
    main_before = {k: v for k, v in model_to_official(target).items() if not k.startswith("mtp.")}
    assert all(np.array_equal(before[k], v) for k, v in main_before.items())  # the target's weights, as loaded

    trainer = DrafterTrainer(model, lr=3e-3, warmup=5, steps=40, anchors=16)
    ids = synthetic_tokens(20_000, cfg.vocab_size, seed=0)
    held = [ids[-65:][None]]
    first = trainer.evaluate(held)
    for i, x in enumerate(batches(ids[:-200], 64, 4, seed=0)):
        if i == 40:
            break
        trainer.step(x)
    last = trainer.evaluate(held)
    assert last["loss"] < first["loss"] - 0.25, (first, last)  # (a random target: its entropy is the floor)

    after = model_to_official(trainer.trained())
    for k, v in before.items():  # the draft layers moved, nothing else did
        if k.startswith("mtp."):
            continue
        assert np.array_equal(after[k], v), k
    moved = {k for k, v in before.items() if k.startswith("mtp.") and not np.array_equal(after[k], v)}
    assert {"mtp.0.main_proj.weight", "mtp.0.attn.wkv.weight", "mtp.0.markov_head.markov_w2.weight"} <= moved

    write(trainer.trained(), str(tmp_path / "ck"))
    llm = _quiet(LLM, str(tmp_path / "ck"), dtype="float32",
                 speculative_config={"method": "dspark", "num_speculative_tokens": 2})
    assert llm.config.dspark_block_size == 3 and llm.config.n_mtp_layers == 1
    loaded = model_to_official(llm.model)
    for k in ("mtp.0.main_proj.weight", "mtp.0.markov_head.markov_w1.weight", "embed.weight"):
        np.testing.assert_array_equal(loaded[k], after[k])
