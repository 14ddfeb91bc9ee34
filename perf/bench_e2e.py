"""End-to-end throughput, side by side in one run: our runtime (plain, EAGLE-3, EAGLE-3.1) against
transformers' greedy/sampling ``generate``, prompt-lookup decoding and assisted generation, on the
bundled demo pair and its three prompt sets, greedy and temperature 1, batch 1 and 4.

    python -m pytest perf/bench_e2e.py --benchmark-json perf/e2e.json      # full (minutes)
    python perf/report.py perf/e2e.json                                   # -> perf/REPORT.md + PNGs
    python -m pytest perf/bench_e2e.py --benchmark-disable                 # CI: 1 prompt x 8 tokens

Each benchmark records in ``extra_info`` the metrics of ``runtime/bench.py`` (tokens/s, τ,
acceptance per position, device, versions); speedups are computed against ``ours-plain`` of the
same set, temperature and batch by the report generator.
"""

from __future__ import annotations

import pytest

from tritonspec.demo import PROMPT_SETS
from tritonspec.runtime.bench import SYSTEMS

SETS = PROMPT_SETS


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("prompt_set", SETS)
@pytest.mark.parametrize("system", SYSTEMS)
def test_e2e(benchmark, e2e, system, prompt_set, temperature, batch):
    bench, sets, pair, n, tokens = e2e
    why = bench.available(system, batch)
    if why:
        pytest.skip(why)
    prompts = sets[prompt_set][: max(n, batch)]
    results = []
    benchmark.pedantic(
        lambda: results.append(bench.run(system, prompts, prompt_set, temperature, batch, tokens)),
        rounds=1,
        iterations=1,
        warmup_rounds=0,
    )
    r = results[-1]
    benchmark.extra_info.update(r.info() | {"pair": pair, "max_new_tokens": tokens})
    assert r.new_tokens == len(prompts) * tokens
