"""`v4jax bench spec`: speculative decoding with the MTP block against plain decoding, through `LLM.generate`.

For the plain engine and each k of `--k`: one untimed `generate` (it compiles), then a timed one of other prompts
(the prefix cache would otherwise serve them), greedy, `--new` tokens each at batch `--batch`. Reports ms per
generated token, the speed against plain decoding, acceptance by draft position and the mean tokens a step
(1 + accepted / steps); the outputs must equal plain decoding's (greedy speculation is lossless), else it fails.
Default model: the embedded one (its trained MTP head), prompts from the openings of plays."""
from __future__ import annotations

import argparse
import json
import time

PROMPTS = [
    "ROMEO:\nBut, soft! what light through yonder window breaks?",
    "HAMLET:\nTo be, or not to be, that is the question:",
    "KING RICHARD III:\nNow is the winter of our discontent",
    "MACBETH:\nIs this a dagger which I see before me,",
    "PORTIA:\nThe quality of mercy is not strain'd,",
    "JAQUES:\nAll the world's a stage,\nAnd all the men and women merely players:",
    "ANTONY:\nFriends, Romans, countrymen, lend me your ears;",
    "PROSPERO:\nOur revels now are ended. These our actors,",
    "LEAR:\nBlow, winds, and crack your cheeks! rage! blow!",
    "HENRY V:\nOnce more unto the breach, dear friends, once more;",
    "OTHELLO:\nIt is the cause, it is the cause, my soul,",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
    "VIOLA:\nMake me a willow cabin at your gate,",
    "PUCK:\nIf we shadows have offended,",
    "BRUTUS:\nThere is a tide in the affairs of men,",
    "CLAUDIO:\nAy, but to die, and go we know not where;",
]


def run(model, ks, new: int, batch: int, dtype: str, max_model_len: int) -> list[dict]:
    from v4jax import LLM, SamplingParams

    sp = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    warm, timed = PROMPTS[:batch], PROMPTS[batch:2 * batch]
    rows, plain = [], None
    for k in [0] + list(ks):
        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        llm = LLM(model, dtype=dtype, max_num_seqs=batch, max_model_len=max_model_len, speculative_config=spec)
        llm.generate(warm, sp)
        before = llm.stats()["spec_decode"]
        t0 = time.perf_counter()
        outs = llm.generate(timed, sp)
        secs = time.perf_counter() - t0
        after = llm.stats()["spec_decode"]
        ids = [o.token_ids for o in outs]
        if plain is None:
            plain = ids
        elif ids != plain:
            raise AssertionError(f"k={k}: greedy outputs differ from plain decoding")
        steps = after["num_drafts"] - before["num_drafts"]
        acc = [a - b for a, b in zip(after["accepted_by_position"], before["accepted_by_position"])]
        n_tok = sum(len(i) for i in ids)
        rows.append({"k": k, "batch": batch, "new": new, "seconds": secs, "ms_per_token": 1e3 * secs / n_tok,
                     "tokens_per_s": n_tok / secs, "steps": steps,
                     "accepted_by_position": [a / steps for a in acc] if steps else [],
                     "tokens_per_step": 1 + sum(acc) / steps if steps else 1.0})
        del llm
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| k | batch | ms / token | tokens/s | vs plain | tokens / step | accepted by position |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = " / ".join(f"{100 * a:.0f} %" for a in r["accepted_by_position"]) or "-"
        lines.append(f"| {r['k'] or 'plain'} | {r['batch']} | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['tokens_per_step']:.2f} | {acc} |")
    return "\n".join(lines)


def spec_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="v4jax bench spec", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory or preset (default: the embedded model)")
    p.add_argument("--k", default="1,2,3", help="comma list of num_speculative_tokens")
    p.add_argument("--new", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--batch", type=int, default=1, help="prompts at once (max_num_seqs)")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    if 2 * a.batch > len(PROMPTS):
        p.error(f"--batch at most {len(PROMPTS) // 2}")
    rows = run(a.model, [int(x) for x in a.k.split(",") if x], a.new, a.batch, a.dtype, a.max_model_len)
    print(markdown(rows))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
