"""Acceptance length of a demo drafter on the demo prompt sets at fixed shapes (no timing).

τ per set = tokens / rounds pooled over the first ``N`` prompts of each set (the harmonic mean of the
per-prompt τ: every prompt generates the same 64 tokens, EOS ignored), greedy with the chain (7,1,8)
and at temperature 1 (seed 1) with the sampled chain (3,1,4); batch 1, one thread. τ depends only on
the drafter, the target and the prompts, so it compares drafters on any machine, busy or not.

    python perf/drafter_tau.py demo/drafter-eagle3.1 tau-eagle3.1.json 20
"""

from __future__ import annotations

import json
import sys

import torch

import tritonspec as ts
from tritonspec import demo

SHAPES = (
    (0.0, ts.SpecConfig(num_speculative_tokens=7, top_k=1, num_draft_tokens=8)),
    (1.0, ts.SpecConfig(num_speculative_tokens=3, top_k=1, num_draft_tokens=4)),
)


def main(drafter_dir: str, out: str, n: int = 8) -> dict:
    torch.set_num_threads(1)
    target_dir, _ = ts.demo_pair("eagle3.1")
    res = {}
    for temperature, spec in SHAPES:
        kw = dict(max_seq_len=2048, spec=spec, max_batch_size=1)
        rt = ts.SpeculativeRuntime.from_pretrained(target_dir, drafter_dir, **kw)
        for name in demo.PROMPT_SETS:
            per = []
            for row in demo.prompt_set(name)[:n]:
                sampling = dict(temperature=temperature, seed=1) if temperature else {}
                g = rt.generate(row["prompt"], max_new_tokens=64, stop_token_ids=[], **sampling)
                per.append(round(g.stats.mean_acceptance_length, 2))
            key = f"T{temperature:g} {name}"
            res[key] = (round(len(per) / sum(1 / x for x in per), 3), per)
            print(key, res[key], flush=True)
    with open(out, "w") as fh:
        json.dump(res, fh, indent=1)
    return res


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 8)
