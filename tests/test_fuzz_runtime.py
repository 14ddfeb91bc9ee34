"""Random runtimes x random requests (hypothesis): the guarantees that must hold whatever the features combine.

Each example draws a runtime (tree or chain shape or the default, a prompt-lookup branch, ``max_batch_size``,
deterministic mode, the adaptive-shape switch: a no-op here, the tiny pair has no tuned profile, so
``perf/fuzz_demo.py`` covers it on the demo pair's shipped ones) and a request (ragged prompts, more of them than
the batch holds, per-prompt budgets, stop tokens, greedy or seeded sampling), and checks:

- greedy: every row equals the plain decoding of its prompt alone (speculation, trees, lookup branches,
  continuous batching's refills and row moves, stops and budgets changing nothing);
- seeded sampling at a fixed shape: every row equals the same runtime's solo run of its prompt;
- deterministic mode, sampling: every row equals plain sampling of its prompt alone (``deterministic=True``
  promises independence of speculation and batch);
- the first prompt streamed alone gives its row's tokens and finish reason.

The pair is ``perm_pair``'s deliberately good drafter, so deep acceptances, lookup hits (prompts drawn from few
tokens repeat) and KV compaction are exercised, not only rejections. ``TRITONSPEC_FUZZ_EXAMPLES=500`` runs more
examples than CI's 30.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tritonspec as ts

from _util import perf_module, perm_pair, random_prompts, runtime

VOCAB = 24


@pytest.fixture(scope="module")
def pair():
    return perm_pair("llama", vocab=VOCAB, seed=3, alpha=0.15)


@st.composite
def specs(draw):
    kind = draw(st.sampled_from(["default", "chain", "tree"]))
    if kind == "default":
        spec = ts.SpecConfig()
    elif kind == "chain":
        spec = ts.SpecConfig.chain(draw(st.integers(1, 6)))
    else:
        depth, top_k = draw(st.integers(1, 4)), draw(st.integers(2, 4))
        most = ts.SpecConfig(num_speculative_tokens=depth, top_k=top_k, num_draft_tokens=2).max_candidates
        spec = ts.SpecConfig(
            num_speculative_tokens=depth, top_k=top_k, num_draft_tokens=draw(st.integers(2, min(most, 24) + 1))
        )
    if draw(st.booleans()):
        longest = draw(st.integers(1, 4))
        spec = dataclasses.replace(
            spec,
            prompt_lookup_num_tokens=draw(st.integers(1, 6)),
            prompt_lookup_max=longest,
            prompt_lookup_min=draw(st.integers(1, longest)),
        )
    return spec


@st.composite
def requests(draw):
    n = draw(st.integers(1, 7))
    alphabet = draw(st.integers(2, VOCAB))  # few distinct tokens: repeats, so prompt lookup finds matches
    prompts = [draw(st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=30)) for _ in range(n)]
    budgets = [draw(st.integers(1, 24)) for _ in range(n)]
    stops = draw(st.lists(st.integers(0, VOCAB - 1), max_size=2))
    temperature = draw(st.sampled_from([0.0, 0.0, 1.0]))
    seeds = [draw(st.integers(0, 2**31 - 1)) for _ in range(n)]
    return prompts, budgets, stops, temperature, seeds


EXAMPLES = int(os.environ.get("TRITONSPEC_FUZZ_EXAMPLES", "30"))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    spec=specs(),
    max_batch_size=st.integers(1, 4),
    deterministic=st.booleans(),
    adaptive=st.booleans(),
    request=requests(),
)
def test_random_runtime_and_request_keep_the_guarantees(pair, spec, max_batch_size, deterministic, adaptive, request):
    model, drafter = pair
    prompts, budgets, stops, temperature, seeds = request
    rt = runtime(
        model, drafter, spec, max_batch_size=max_batch_size, deterministic=deterministic, adaptive_shape=adaptive
    )
    kw = dict(temperature=temperature, stop_token_ids=stops)
    out = rt.generate(prompts, max_new_tokens=budgets, seed=seeds, **kw)
    assert len(out.token_ids) == len(prompts)
    if len(prompts) > max_batch_size:
        assert out.stats.rows_refilled == len(prompts) - max_batch_size
    for p, n, seed, row, reason in zip(prompts, budgets, seeds, out.token_ids, out.finish_reasons):
        assert 1 <= len(row) <= n
        assert (reason == "stop") == (row[-1] in stops), (row, reason)
        if reason == "length":
            assert len(row) == n
        if temperature == 0 or deterministic:  # plain decoding of the prompt alone
            ref = rt.generate([p], max_new_tokens=n, seed=seed, speculative=False, **kw).token_ids[0]
        else:  # seeded sampling at this fixed shape: the same runtime's solo run
            ref = rt.generate([p], max_new_tokens=n, seed=seed, **kw).token_ids[0]
        assert row == ref, (p, n, seed)
    pieces = list(rt.stream(prompts[0], max_new_tokens=budgets[0], seed=seeds[0], **kw))  # speculative, alone
    assert [t for piece in pieces for t in piece.token_ids] == out.token_ids[0]
    assert pieces[-1].finish_reason == out.finish_reasons[0]


def test_the_fuzz_compares_rows_it_could_get_wrong(pair):
    """Inverse: the comparison above is not vacuous. Rows of different prompts differ, and a sampled row
    changes with its seed, so a runtime that mixed up rows or seeds would fail it."""
    model, drafter = pair
    rt = runtime(model, drafter, ts.SpecConfig.chain(3), max_batch_size=2)
    a, b = random_prompts(VOCAB, [5, 9], seed=0)
    greedy = rt.generate([a, b], max_new_tokens=12)
    assert greedy.token_ids[0] != greedy.token_ids[1]
    sampled = [rt.generate([a], max_new_tokens=12, temperature=1.0, seed=s).token_ids[0] for s in range(4)]
    assert len({tuple(r) for r in sampled}) > 1
    torch.manual_seed(0)  # the runtime's draws are its own: the global generator changes nothing
    assert rt.generate([a], max_new_tokens=12, temperature=1.0, seed=1).token_ids[0] == sampled[1]


@pytest.mark.parametrize("mode", ["runtime", "stop"])
def test_demo_fuzz_script_runs_and_counts(mode, capsys):
    """``perf/fuzz_demo.py`` (the long-running version on the demo pair) for a few seconds: it runs and reports."""
    from tritonspec import demo

    if not demo.available():
        pytest.skip("the demo pair is not built here")
    fuzz = perf_module("fuzz_demo")
    assert fuzz.main([mode, "--seed", "3", "--minutes", "0.02"]) == 0
    done = re.search(r"(\d+) rows compared, (\d+) mismatches", capsys.readouterr().out)
    assert done and int(done[1]) > 0 and done[2] == "0"  # rows were compared, not all skipped
