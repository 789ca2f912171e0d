"""CPU smoke tests of the default-model training (v4jax/training/train.py, scripts/train_default_model.py)."""
from __future__ import annotations

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v4jax.training.train import (Trainer, default_model_config, routed_bias_keys, smoke_model_config,
                         smoke_train_config, synthetic_tokens)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 30


def _script():
    """scripts/train_default_model.py as a module. Importing it adds a GPU flag to XLA_FLAGS (for its own process,
    before JAX starts); here JAX has started and never reads it again, but the persistent compilation cache keys
    do: the test process keeps its XLA_FLAGS, so that its later programs still match the cache's entries."""
    spec = importlib.util.spec_from_file_location("train_default_model",
                                                  os.path.join(ROOT, "scripts", "train_default_model.py"))
    mod = importlib.util.module_from_spec(spec)
    flags = os.environ.get("XLA_FLAGS")
    try:
        spec.loader.exec_module(mod)
    finally:
        if flags is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = flags
    return mod


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smoke")
    summary = _script().main(["--smoke", "--data", str(tmp / "no-data"), "--work", str(tmp / "work"),
                              "--export", str(tmp / "export"), "--steps", str(STEPS), "--eval-every", "0",
                              "--log-every", "5"])
    recs = [json.loads(line) for line in open(tmp / "work" / "log.jsonl")]
    return tmp, summary, [r for r in recs if "step" in r]


def test_smoke_losses(smoke_run):
    _, summary, recs = smoke_run
    assert summary["steps_done"] == STEPS and not summary["stopped_early"]
    first, last = recs[0], recs[-1]
    assert first["step"] == 1 and last["step"] == STEPS
    for r in recs:
        for k in ("loss", "ce", "mtp_ce", "idx_kl", "idx_recall", "grad_norm"):
            assert np.isfinite(r[k]), (k, r)
    assert last["ce"] < first["ce"] - 1.0, (first["ce"], last["ce"])  # the loss goes down
    assert last["mtp_ce"] < first["mtp_ce"] - 1.0
    assert last["idx_kl"] < first["idx_kl"], (first["idx_kl"], last["idx_kl"])  # the indexer learns
    assert 0.0 < last["idx_recall"] <= 1.0


def test_smoke_export_loads(smoke_run):
    from flax import nnx

    from checkpoints import open_checkpoint
    from v4jax.model import Transformer
    from v4jax.model.weights import load_tensors

    tmp, _, _ = smoke_run
    ckpt = open_checkpoint(tmp / "export")
    assert ckpt.has_mtp
    assert ckpt.cfg == smoke_model_config(2048)
    model = load_tensors(nnx.eval_shape(lambda: Transformer(ckpt.cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)),
                         ckpt.iter_tensors())
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, tokens):
        m = nnx.merge(graphdef, state)
        logits, streams = m(tokens, return_streams=True)
        return logits, m.mtp_logits(streams, tokens)

    logits, mtp = fwd(state, jnp.asarray(synthetic_tokens(65, 2048, seed=3)[None, :64]))
    assert np.isfinite(np.asarray(logits)).all() and np.isfinite(np.asarray(mtp)).all()
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp / "export" / f).exists()


def test_resume_is_exact(tmp_path, smoke_run):
    """Save after 2 steps, continue 2 more; a fresh trainer restored from the save reproduces them exactly
    (same jit cache as the smoke run: same config)."""
    from v4jax.training.data import batches

    cfg, tc = smoke_model_config(2048), smoke_train_config(steps=STEPS)
    toks = synthetic_tokens(50_000, 2048)
    a = Trainer(cfg, tc)
    stream = batches(toks, tc.seq_len + 1, tc.batch_size, seed=tc.seed)
    for _ in range(2):
        a.step(next(stream))
    path = str(tmp_path / "state.npz")
    a.save(path)
    for _ in range(2):
        a.step(next(stream))
    b = Trainer(cfg, tc)
    b.restore(path)
    assert b.step_count == 2
    stream_b = batches(toks, tc.seq_len + 1, tc.batch_size, seed=tc.seed, start_step=b.step_count)
    for _ in range(2):
        b.step(next(stream_b))
    for k in a.params:
        np.testing.assert_array_equal(np.asarray(a.params[k]), np.asarray(b.params[k]), err_msg=k)
    # the load-balancing bias moved (it gets no gradient)
    k = routed_bias_keys(cfg)[0]
    assert not np.array_equal(np.asarray(a.params[k]), np.asarray(Trainer(cfg, tc).params[k]))


def test_auto_steps_inside_warmup_is_exact(smoke_run):
    """Fixing the step count during the warmup (--auto-steps) gives the run that started with that count."""
    from v4jax.training.data import batches

    cfg = smoke_model_config(2048)
    toks = synthetic_tokens(50_000, 2048)
    a = Trainer(cfg, smoke_train_config(steps=1000))
    b = Trainer(cfg, smoke_train_config(steps=12))
    sa = batches(toks, a.tc.seq_len + 1, a.tc.batch_size, seed=0)
    sb = batches(toks, b.tc.seq_len + 1, b.tc.batch_size, seed=0)
    for i in range(12):
        if i == 3:
            a.set_total_steps(12)
        a.step(next(sa))
        b.step(next(sb))
    for k in a.params:
        np.testing.assert_array_equal(np.asarray(a.params[k]), np.asarray(b.params[k]), err_msg=k)
    with pytest.raises(ValueError):
        a.set_total_steps(20)  # past the warmup


def test_default_config_every_feature():
    cfg = default_model_config()
    assert {"sliding", "csa", "hca"} <= set(cfg.layer_types)
    assert cfg.n_hash_layers >= 1 and cfg.n_layers > cfg.n_hash_layers  # hash-routed and top-k-routed layers
    assert cfg.hc_mult > 1 and cfg.n_mtp_layers == 1 and cfg.index_n_heads >= 16
    t = 512
    assert cfg.window_size < t and cfg.index_topk < t // min(cfg.ratios_in_use)  # the top-k binds at T=512
