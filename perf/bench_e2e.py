"""End-to-end throughput, side by side in one run: our runtime (plain, EAGLE-3, EAGLE-3.1) against
transformers' greedy/sampling ``generate``, prompt-lookup decoding and assisted generation, on the
bundled demo pair and its three prompt sets, greedy and temperature 1, batch 1 and 4.

    python -m pytest perf/bench_e2e.py --benchmark-json perf/e2e.json      # full (minutes)
    python -m pytest perf/bench_e2e.py --e2e-passes 3 --benchmark-json perf/e2e.json  # per-pass speedups
    python perf/report.py perf/e2e.json                                   # -> perf/REPORT.md + PNGs
    python -m pytest perf/bench_e2e.py --benchmark-disable                 # CI: 1 prompt x 8 tokens

One benchmark per prompt set, temperature and batch runs every system that applies there,
interleaved (``Bench.run_interleaved``: each chunk of prompts runs every system in turn, in a
rotating order), so load swings on a shared machine fall on all systems alike; pytest-benchmark's
own time is the whole group's. ``extra_info["systems"]`` holds one record per system with the
metrics of ``runtime/bench.py`` (tokens/s, τ, acceptance per position, device, versions) and
``skipped`` the systems that do not apply, with why; speedups are computed against ``ours-plain``
of the same group by the report generator.
"""

from __future__ import annotations

import pytest

from tritonspec.demo import PROMPT_SETS
from tritonspec.runtime.bench import SYSTEMS

SETS = PROMPT_SETS


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("prompt_set", SETS)
def test_e2e(benchmark, e2e, prompt_set, temperature, batch, request):
    bench, sets, pair, n, tokens = e2e
    passes = request.config.getoption("--e2e-passes")
    skipped = {s: why for s in SYSTEMS if (why := bench.available(s, batch))}
    systems = [s for s in SYSTEMS if s not in skipped]
    prompts = sets[prompt_set][: max(n, batch)]
    results = []
    benchmark.pedantic(
        lambda: results.append(
            bench.run_interleaved(systems, prompts, prompt_set, temperature, batch, tokens, passes=passes)
        ),
        rounds=1,
        iterations=1,
        warmup_rounds=0,
    )
    res = results[-1]
    benchmark.extra_info.update(
        systems=[res[s].info() | {"pair": pair, "max_new_tokens": tokens} for s in systems], skipped=skipped
    )
    assert "ours-plain" in res
    for s in systems:
        assert res[s].new_tokens == len(prompts) * tokens, s
        assert res[s].wall_time_s > 0 and len(res[s].pass_wall_s) == passes, s
        if s.startswith("ours-"):  # the same prompts and seeds: the same tokens every pass
            assert res[s].same_tokens_every_pass is not False, s
