"""Out-of-the-box speed: what a user who never ran the tuner gets, side by side in one run.

For the bundled demo pair (EAGLE-3.1 and EAGLE-3), greedy, batch 1, 2, 4 and 8, one torch thread:
``plain`` decoding, the user ``default`` (``spec=None`` with an empty user cache, so the profile
shipped with the package or the rule picks the shape), and every candidate shape the tuner weighs
at that batch size (``autotune.tree_tuner.candidates_at``). All are generated interleaved per batch
of prompts (``tree_measure.measure_generation``), so machine load hits them alike.

    python -m pytest perf/bench_defaults.py --benchmark-json perf/defaults.json    # ~minutes
    python -m pytest perf/bench_defaults.py --benchmark-disable                    # CI: 1 batch x 4 tokens

``extra_info`` per benchmark: decode tokens/s of each system, the default's shape and source,
``default_vs_best`` (default / the fastest candidate or plain) and ``default_vs_plain``.
Goals (issue "out-of-the-box speed"): default within 5% of the best at batch 1 and 4; never below
plain decoding at batch 1-8.
"""

from __future__ import annotations

import os

import pytest
import torch

import tritonspec as ts
from tritonspec.autotune.tree_measure import measure_generation
from tritonspec.autotune.tree_tuner import candidates_at
from tritonspec.demo import prompt_set
from tritonspec.kernels import store

FULL = not os.environ.get("CI")


@pytest.mark.parametrize("batch", [1, 2, 4, 8])
@pytest.mark.parametrize("variant", ["eagle3.1", "eagle3"])
def test_defaults(benchmark, tmp_path, monkeypatch, variant, batch):
    monkeypatch.delenv(store.ENV_DIR, raising=False)
    monkeypatch.setenv("TRITONSPEC_CACHE", str(tmp_path))  # a fresh user cache: only shipped profiles
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t, d = ts.demo_pair(variant)
        rt = ts.SpeculativeRuntime.from_pretrained(t, d, max_batch_size=8, max_seq_len=1024)
        default = rt.shape_policy.choose(batch, True)
        chosen = rt.shape_policy.choose(1, True).spec or ts.SpecConfig.chain(1)
        largest = ts.SpecConfig(6, 2, 13)
        cands = [s for s in candidates_at(batch, True, chosen, largest) if s != default.spec]
        n, tokens = (8, 48) if FULL else (batch, 4)
        prompts = [r["prompt"][-1500:] for r in prompt_set("standard")[:n]]
        rt.spec = largest  # sizes the caches once for every shape measured
        results = []
        specs = [None, default.spec, *cands]
        benchmark.pedantic(
            lambda: results.append(measure_generation(rt, prompts, tokens, specs, batch_size=batch)),
            rounds=1,
            iterations=1,
            warmup_rounds=0,
        )
    finally:
        torch.set_num_threads(threads)
    plain, dflt, *rest = results[-1]
    rate = {"plain": plain.decode_tokens_per_s, "default": dflt.decode_tokens_per_s}
    for s, m in zip(cands, rest):
        rate[f"({s.num_speculative_tokens},{s.top_k},{s.num_draft_tokens})"] = m.decode_tokens_per_s
    best = max(v for k, v in rate.items() if k != "default")
    benchmark.extra_info.update(
        variant=variant,
        batch=batch,
        default_spec=None if default.spec is None else str(default.spec),
        default_source=default.source,
        decode_tokens_per_s={k: round(v, 2) for k, v in rate.items()},
        default_vs_best=round(rate["default"] / max(best, rate["default"]), 3),
        default_vs_plain=round(rate["default"] / rate["plain"], 3),
        max_new_tokens=tokens,
        prompts=len(prompts),
    )
    assert dflt.token_ids == plain.token_ids  # greedy: whatever the shape, the target's output
