"""`v4jax bench table DIR [DIR ...]`: one markdown table of decode speed from the JSON files benchmark runs wrote.

Every `decode.json` (`v4jax bench decode --out DIR`) and `generate.json` (`v4jax bench generate --out DIR`) found
under the given directories (recursively; a JSON file can be named directly too) is merged into one row per
(model, batch, context):

  jit ms/step        decode.json rows[].ms_per_step (the jitted decode call)
  engine ms/step     decode.json rows[].generate_step_ms_per_step (the EngineCore.step loop)
  generate ms/step   generate.json rows[].ms_per_step (through LLM.generate); steady: rows[].steady_ms_per_step
  tok/s              batch * 1000 / jit ms
  roofline ms        decode.json rows[].roofline_ms; % of roofline = roofline / jit * 100; x roofline = ms / roofline
  HF ms/step         decode.json hf[].ms_per_step; speed-up vs HF = HF / engine ms

and a prefill table from generate.json (prefill_s: the max_tokens=1 wall time; prefill_tflop over it against
matmul_tflops, the bf16 matmul rate measured in the same run: v4jax.bench.flops) with the HF peer's chunked
prefill (decode.json hf[].prefill_s) where it was measured. The model is each file's `model` (generate.json) or
`config_name` (decode.json); `DIR=LABEL` names every file under DIR LABEL instead (to tell stages apart). Rows
that ended in an error are left out; where several files measure the same row, the later file's values win.
Missing numbers print as '-'.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from v4jax.bench.decode import _ctx


def _model(data: dict) -> str:
    name = str(data.get("label") or data.get("model") or data.get("config_name") or "?")
    return os.path.basename(name.rstrip("/")) if os.sep in name else name


def _merge(out: dict, key, **values):
    row = out.setdefault(key, {})
    row.update({k: v for k, v in values.items() if v is not None})


def _div(a, b):
    return a / b if a is not None and b else None


def _order(out: dict, fields: tuple) -> list[dict]:
    models = list(dict.fromkeys(k[0] for k in out))
    return [dict(dict.fromkeys(fields), **out[k], model=k[0], batch=k[1], context=_ctx(k[2]), context_tokens=k[2])
            for k in sorted(out, key=lambda k: (models.index(k[0]), k[1], k[2]))]


def build_rows(decode_jsons: list[dict], generate_jsons: list[dict]) -> list[dict]:
    """One dict per (model, batch, context), values None where not measured."""
    out: dict = {}
    for d in decode_jsons:
        m = _model(d)
        for r in d.get("rows", []):
            if "error" not in r:
                _merge(out, (m, r["batch"], r["context"]), jit_ms=r.get("ms_per_step"),
                       engine_ms=r.get("generate_step_ms_per_step"), roofline_ms=r.get("roofline_ms"))
        for h in d.get("hf", []):
            if "error" not in h:
                _merge(out, (m, h["batch"], h["context"]), hf_ms=h.get("ms_per_step"))
    for g in generate_jsons:
        m = _model(g)
        for r in g.get("rows", []):
            if "error" not in r:
                _merge(out, (m, r["batch"], r["context"]), generate_ms=r.get("ms_per_step"),
                       steady_ms=r.get("steady_ms_per_step"))
    rows = _order(out, ("jit_ms", "engine_ms", "roofline_ms", "hf_ms", "generate_ms", "steady_ms"))
    for r in rows:
        jit, eng, rl = r["jit_ms"], r["engine_ms"], r["roofline_ms"]
        r.update(tok_s=_div(r["batch"] * 1000.0, jit), roofline_pct=_div(rl * 100.0, jit) if rl else None,
                 x_roofline_jit=_div(jit, rl), x_roofline_engine=_div(eng, rl),
                 hf_speedup=_div(r["hf_ms"], eng))
    return rows


def prefill_rows(generate_jsons: list[dict], decode_jsons: list[dict] = ()) -> list[dict]:
    """One dict per (model, batch, prompt length) of generate.json, with the HF peer's prefill s if measured."""
    out: dict = {}
    for g in generate_jsons:
        for r in g.get("rows", []):
            if "error" not in r:
                _merge(out, (_model(g), r["batch"], r["context"]), prefill_s=r.get("prefill_s"),
                       tflop=r.get("prefill_tflop"), matmul_tflops=g.get("matmul_tflops"))
    hf = {(_model(d), h["batch"], h["context"]): h.get("prefill_s") for d in decode_jsons for h in d.get("hf", [])
          if "error" not in h}
    rows = _order(out, ("prefill_s", "tflop", "matmul_tflops"))
    for r in rows:
        rate = _div(r["tflop"], r["prefill_s"])
        r.update(tok_s=_div(r["batch"] * r["context_tokens"], r["prefill_s"]), tflops=rate,
                 matmul_pct=_div(rate * 100.0, r["matmul_tflops"]) if rate else None,
                 hf_prefill_s=hf.get((r["model"], r["batch"], r["context_tokens"])))
    return rows


DECODE_COLUMNS = (("model", "model", "{}"), ("batch", "batch", "{}"), ("context", "context", "{}"),
                  ("jit ms/step", "jit_ms", "{:.2f}"), ("engine ms/step", "engine_ms", "{:.2f}"),
                  ("generate ms/step", "generate_ms", "{:.2f}"), ("steady generate ms/step", "steady_ms", "{:.2f}"),
                  ("tok/s (jit)", "tok_s", "{:.0f}"), ("roofline ms", "roofline_ms", "{:.2f}"),
                  ("% of roofline", "roofline_pct", "{:.0f}"), ("x roofline (jit)", "x_roofline_jit", "{:.2f}x"),
                  ("x roofline (engine)", "x_roofline_engine", "{:.2f}x"), ("HF ms/step", "hf_ms", "{:.2f}"),
                  ("speed-up vs HF (engine)", "hf_speedup", "{:.1f}x"))
PREFILL_COLUMNS = (("model", "model", "{}"), ("batch", "batch", "{}"), ("prompt", "context", "{}"),
                   ("prefill s (max_tokens=1)", "prefill_s", "{:.2f}"), ("prompt tok/s", "tok_s", "{:.0f}"),
                   ("TFLOP", "tflop", "{:.1f}"), ("TFLOP/s", "tflops", "{:.0f}"),
                   ("% of bf16 matmul rate", "matmul_pct", "{:.0f}"),
                   ("HF prefill s (chunked)", "hf_prefill_s", "{:.2f}"))


def _table(rows: list[dict], columns) -> list[str]:
    cell = lambda r, key, fmt: "-" if r.get(key) is None else fmt.format(r[key])
    return (["| " + " | ".join(c[0] for c in columns) + " |", "|" + "|".join("---:" for _ in columns) + "|"]
            + ["| " + " | ".join(cell(r, key, fmt) for _, key, fmt in columns) + " |" for r in rows])


def markdown(rows: list[dict], prefill: list[dict]) -> str:
    lines = _table(rows, DECODE_COLUMNS)
    if prefill:
        lines += [""] + _table(prefill, PREFILL_COLUMNS)
    return "\n".join(lines) + "\n"


def load(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """(decode jsons, generate jsons) under each `PATH` or `PATH=LABEL`, in path order."""
    found = {"decode.json": [], "generate.json": []}
    for arg in paths:
        path, label = (arg, "") if os.path.exists(arg) or "=" not in arg else arg.rsplit("=", 1)
        files = [path] if os.path.isfile(path) else sorted(
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f in found)
        for f in files:
            with open(f) as fh:
                data = json.load(fh)
            found[os.path.basename(f)].append(dict(data, label=label) if label else data)
    return found["decode.json"], found["generate.json"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="v4jax bench table", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", metavar="DIR[=LABEL]", help="folders searched for decode.json and "
                    "generate.json (or those files); =LABEL names the model of every file found there")
    ap.add_argument("--out", default=None, help="also write the markdown to this file")
    a = ap.parse_args(argv)
    dec, gen = load(a.dirs)
    if not dec and not gen:
        print(f"error: no decode.json or generate.json under {' '.join(a.dirs)}", file=sys.stderr)
        return 1
    text = markdown(build_rows(dec, gen), prefill_rows(gen, dec))
    print(text, end="")
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
