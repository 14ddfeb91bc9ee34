"""Shapes by the rows a round runs (``SpeculativeRuntime._by_width``): a greedy request re-chooses its
draft tree from the policy when the running rows change (a static batch narrowing as its rows stop, a
continuous batch refilled or draining, a long prompt leaving); output unchanged."""

from __future__ import annotations

import pytest

import tritonspec as ts
from tritonspec.runtime.adaptive import LAMBDAS, ShapeLadder
from tritonspec.runtime.spec_policy import ShapePolicy

from _util import perm_pair, random_prompts, runtime

S, C = ts.SpecConfig, ts.SpecConfig.chain
ONE, TWO, FOUR = C(5), C(3), S(2, 2, 4)  # the measured shapes at batch 1, 2 and 4


@pytest.fixture(scope="module")
def pair():
    return perm_pair("llama", vocab=24, seed=3, alpha=0.3)


def with_policy(rt: ts.SpeculativeRuntime, table: dict, contexts: dict | None = None) -> ts.SpeculativeRuntime:
    """``rt`` under a profile-like policy (its caches are fitted to it by the next request)."""
    rt._policy = ShapePolicy("profile", 8, table=table, contexts=contexts or {})
    return rt


TABLE = {(1, "greedy"): ONE, (2, "greedy"): TWO, (4, "greedy"): FOUR}


@pytest.mark.parametrize("adaptive", [True, False])
def test_a_narrowing_batch_runs_each_widths_shape(pair, adaptive):
    """Budgets 3, 8, 16 and 40: the batch runs 4, 3, 2 and 1 rows wide, so it drafts FOUR (batch 3 takes
    batch 4's row), then TWO, then ONE: two switches, the target's tokens. The inverse: with
    ``adaptive_shape=False`` every round keeps FOUR."""
    rt = with_policy(runtime(*pair, max_batch_size=4, adaptive_shape=adaptive), TABLE)
    prompts = random_prompts(24, [6, 9, 5, 7], seed=1)
    budgets = [3, 8, 16, 40]
    out = rt.generate(prompts, max_new_tokens=budgets, stop_token_ids=[])
    plain = rt.generate(prompts, max_new_tokens=budgets, stop_token_ids=[], speculative=False)
    assert out.token_ids == plain.token_ids and [len(t) for t in out.token_ids] == budgets
    assert out.stats.spec == FOUR and rt.spec == FOUR  # the shape it started with
    if adaptive:
        assert set(out.stats.rounds_per_shape) == {FOUR.label, TWO.label, ONE.label}
        assert out.stats.shape_switches == 2
        assert len(out.stats.accepted_per_position) == ONE.tree_depth  # grown to the deepest shape run
    else:
        assert set(out.stats.rounds_per_shape) == {FOUR.label} and out.stats.shape_switches == 0
        assert len(out.stats.accepted_per_position) == FOUR.tree_depth


def test_sampled_rows_keep_their_shape(pair):
    """A seeded sampled row's draws follow its rounds: its shape never changes with the batch (the output
    equals the run that never adapts)."""
    prompts = random_prompts(24, [6, 9, 5, 7], seed=1)
    kw = dict(max_new_tokens=[3, 8, 16, 30], stop_token_ids=[], temperature=1.0, seed=[1, 2, 3, 4])
    table = TABLE | {(b, "sampled"): s for (b, _), s in TABLE.items()}
    out = with_policy(runtime(*pair, max_batch_size=4), table).generate(prompts, **kw)
    fixed = with_policy(runtime(*pair, max_batch_size=4, adaptive_shape=False), table).generate(prompts, **kw)
    assert set(out.stats.rounds_per_shape) == {FOUR.label} and out.stats.shape_switches == 0
    assert out.token_ids == fixed.token_ids


def test_a_long_prompt_leaving_the_batch_takes_the_short_bucket(pair):
    """A policy whose prompts of 40+ tokens run ``C(1)``: while the long prompt runs, the batch drafts
    ``C(1)``; once it stops, the short prompt's bucket (``C(3)``)."""
    long_rows = ShapePolicy("profile", 8, table={(1, "greedy"): C(1), (2, "greedy"): C(1)})
    rt = with_policy(
        runtime(*pair, max_batch_size=2), {(1, "greedy"): TWO, (2, "greedy"): TWO}, contexts={40: long_rows}
    )
    prompts = random_prompts(24, [45, 6], seed=2)
    out = rt.generate(prompts, max_new_tokens=[4, 24], stop_token_ids=[])
    assert out.token_ids == rt.generate(prompts, max_new_tokens=[4, 24], stop_token_ids=[], speculative=False).token_ids
    assert out.stats.spec == C(1) and set(out.stats.rounds_per_shape) == {C(1).label, TWO.label}
    assert out.stats.shape_switches == 1


def test_a_new_requests_first_shape_is_no_switch(pair):
    """One row, requests in turn (continuous batching), long and short prompts alternating: each request
    starts on its own bucket's shape, and none of those changes counts as a switch."""
    long_rows = ShapePolicy("profile", 8, table={(1, "greedy"): C(1)})
    rt = with_policy(runtime(*pair, max_batch_size=1), {(1, "greedy"): TWO}, contexts={40: long_rows})
    prompts = random_prompts(24, [45, 6, 50, 7], seed=3)
    out = rt.generate(prompts, max_new_tokens=10, stop_token_ids=[])
    assert out.stats.rows_refilled == 3 and out.stats.shape_switches == 0
    assert set(out.stats.rounds_per_shape) == {C(1).label, TWO.label}
    assert out.token_ids == rt.generate(prompts, max_new_tokens=10, stop_token_ids=[], speculative=False).token_ids


def test_a_row_left_alone_takes_the_batch_one_ladder(pair):
    """A batch of 2 narrowing to one row: that row runs the batch-1 shape and its ladder
    (``runtime/adaptive.py``), here one that always prefers ``C(2)``."""
    rt = with_policy(runtime(*pair, max_batch_size=2), {(1, "greedy"): ONE, (2, "greedy"): TWO})
    n = len(LAMBDAS)
    rt._policy.ladders[1, "greedy"] = ShapeLadder((ONE, C(2)), ((2.0,) * n, (2.0,) * n), (1.0, 0.5), (1,) * n)
    prompts = random_prompts(24, [6, 9], seed=4)
    out = rt.generate(prompts, max_new_tokens=[3, 40], stop_token_ids=[])
    assert out.token_ids == rt.generate(prompts, max_new_tokens=[3, 40], stop_token_ids=[], speculative=False).token_ids
    assert {TWO.label, ONE.label, C(2).label} <= set(out.stats.rounds_per_shape)
    assert out.stats.shape_switches == 2  # TWO -> ONE as the batch narrows, ONE -> C(2) by the ladder


def test_a_callers_shape_is_kept(pair):
    """``spec=`` pins the shape whatever the rows (the policy is the caller's)."""
    rt = runtime(*pair, FOUR, max_batch_size=4)
    out = rt.generate(random_prompts(24, [6, 9, 5, 7], seed=1), max_new_tokens=[3, 8, 16, 40], stop_token_ids=[])
    assert set(out.stats.rounds_per_shape) == {FOUR.label} and out.stats.shape_switches == 0
