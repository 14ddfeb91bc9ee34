"""Compiled CPU decode rounds against eager ones, side by side in one run (issue "throughput on the CPU").

The demo pair, EAGLE-3.1, greedy, batch 1, one torch thread: plain and speculative decoding, each
eager (``compile=False``) and compiled (``compile=True``: the round ``torch.compile``d, plain
decoding's one-token round too, so the comparison stays fair). Compilation happens in
``warmup()``-like first calls outside the timing; its wall time is recorded.

    python -m pytest perf/bench_compiled.py -m slow --benchmark-json perf/compiled.json   # ~5 min

``extra_info``: tokens/s per system, ``compile_s`` per compiled runtime, speedups over eager
plain and over compiled plain, τ, and whether every system's tokens equal eager plain's.
Marked ``slow`` (compiling two keys takes minutes on 2 cores).
"""

from __future__ import annotations

import time

import pytest
import torch

import tritonspec as ts

TOKENS = 64
PROMPTS = 4


@pytest.mark.slow
def test_compiled_rounds(benchmark):
    if not ts.demo.available():
        pytest.skip("the demo pair is not built")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t, d = ts.demo_pair("eagle3.1")
        spec = ts.SpecConfig(4, 1, 5)
        prompts = [r["prompt"][-1200:] for r in ts.demo.prompt_set("standard")[:PROMPTS]]
        rts, compile_s = {}, {}
        for mode in (False, True):
            rt = ts.SpeculativeRuntime.from_pretrained(t, d, spec=spec, max_batch_size=1, max_seq_len=768, compile=mode)
            t0 = time.perf_counter()
            for sp in (False, True):  # the first round of each key compiles
                rt.generate(prompts[0], max_new_tokens=4, speculative=sp)
            compile_s["compiled" if mode else "eager"] = round(time.perf_counter() - t0, 1)
            rts["compiled" if mode else "eager"] = rt
        rate: dict[str, list[float]] = {}
        taus: dict[str, list[float]] = {}
        tokens: dict[str, list] = {}

        def run():
            for p in prompts:  # interleaved: machine load hits every system alike
                for mode, rt in rts.items():
                    for sp in (False, True):
                        name = f"{mode}-{'eagle3.1' if sp else 'plain'}"
                        t0 = time.perf_counter()
                        out = rt.generate(p, max_new_tokens=TOKENS, speculative=sp)
                        rate.setdefault(name, []).append(out.stats.num_new_tokens / (time.perf_counter() - t0))
                        taus.setdefault(name, []).append(out.stats.mean_acceptance_length)
                        tokens.setdefault(name, []).append(out.token_ids)

        benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=0)
    finally:
        torch.set_num_threads(threads)
    tps = {k: round(sum(v) / len(v), 1) for k, v in rate.items()}
    benchmark.extra_info.update(
        tokens_per_s=tps,
        compile_s=compile_s,
        tau={k: round(sum(v) / len(v), 2) for k, v in taus.items()},
        speedup_vs_eager_plain={k: round(v / tps["eager-plain"], 2) for k, v in tps.items()},
        speedup_vs_compiled_plain={k: round(v / tps["compiled-plain"], 2) for k, v in tps.items()},
        identical_to_eager_plain={k: v == tokens["eager-plain"] for k, v in tokens.items()},
        threads=1,
        max_new_tokens=TOKENS,
        prompts=len(prompts),
        spec=str(spec),
    )
    assert all(v == tokens["eager-plain"] for v in tokens.values())
