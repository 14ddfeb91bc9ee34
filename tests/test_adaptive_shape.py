"""Adaptive shapes (runtime/adaptive.py): a batch-1 greedy request re-chooses its draft tree between
rounds from the acceptance it shows, among the shapes a tuned profile measured; output unchanged."""

from __future__ import annotations

import warnings
from dataclasses import asdict, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tritonspec as ts
from tritonspec.runtime import adaptive as ad
from tritonspec.runtime import profiles as prof
from tritonspec.runtime.adaptive import LAMBDAS, LONG_MIN_ROUNDS, MIN_ROUNDS, ShapeLadder, scaled
from tritonspec.runtime.shape_model import AcceptanceProfile, CostModel

from _util import perm_pair, random_prompts, runtime

S = ts.SpecConfig
BIG, SMALL = S(4, 2, 9), S(2, 1, 3)


def costs(verify_per_row: float = 0.1) -> CostModel:
    """A device where every verified row beyond the first costs ``verify_per_row`` of a plain step."""
    ns = [1, 2, 4, 8, 16]
    return CostModel(
        ns, [1.0 + verify_per_row * (n - 1) for n in ns], {1: 0.05, 2: 0.06}, {1: 0.05, 2: 0.06}, (0.02, 0.0), 1.0
    )


def acceptance(p0: float = 0.7, depth: int = 5) -> AcceptanceProfile:
    return AcceptanceProfile([[p0, (1 - p0) * 0.4] for _ in range(depth)], [100] * depth)


# ------------------------------------------------------------------ the model pieces
@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.lists(st.floats(0, 1), min_size=2, max_size=4), min_size=1, max_size=5).filter(
        lambda rows: len({len(r) for r in rows}) == 1
    ),
    st.floats(0.2, 2.0),
)
def test_scaled_acceptance_stays_a_probability_and_grows_with_lambda(p, lam):
    # a measured level: ranks are exclusive events (sum <= 1), the drafter's rank 0 likeliest
    p = [sorted((x / max(sum(r), 1.0) for x in r), reverse=True) for r in p]
    acc = AcceptanceProfile(p)
    lo, hi = scaled(acc, lam), scaled(acc, lam * 1.25)
    for r_lo, r_hi, r in zip(lo.p, hi.p, p):
        for k in range(1, len(r) + 1):  # P(one of the first k ranks) = min(lam P(<= k), 1): grows with lam
            assert abs(sum(r_lo[:k]) - min(lam * sum(r[:k]), 1.0)) < 1e-9
            assert sum(r_hi[:k]) >= sum(r_lo[:k]) - 1e-12
        assert all(0.0 <= a <= x * lam + 1e-12 for a, x in zip(r_lo, r))
    for k in (1, 2):
        t_lo, t_hi = lo.tokens_per_round(len(p), k), hi.tokens_per_round(len(p), k)
        assert all(b >= a - 1e-9 for a, b in zip(t_lo, t_hi))


def test_ladder_tables_rise_with_lambda_and_favour_deep_trees_at_high_acceptance():
    lad = ShapeLadder.build([BIG, SMALL, S(1, 1, 2)], acceptance(), costs())
    assert lad is not None and lad.shapes == (BIG, SMALL, S(1, 1, 2))
    for row in lad.tau:
        assert all(b >= a - 1e-12 for a, b in zip(row, row[1:]))  # the residual is monotone in λ
        assert row[0] >= 1.0
    assert lad.shapes[lad.best[-1]] == BIG  # accepted deep: the deep tree
    assert lad.shapes[lad.best[0]] != BIG  # hardly accepted: a small one
    assert lad.round_s[0] > lad.round_s[1] > lad.round_s[2]


def test_ladder_drops_shapes_the_model_cannot_predict():
    acc = acceptance(depth=3)
    assert ShapeLadder.build([S(3, 2, 7), S(5, 1, 6)], acc, costs()) is None  # depth 5 > 3 measured: one left
    assert ShapeLadder.build([S(3, 2, 7), S(3, 4, 9)], acc, costs()) is None  # top-k 4 > 2 ranks measured
    lad = ShapeLadder.build([S(3, 2, 7), S(2, 1, 3), S(3, 2, 7)], acc, costs())
    assert lad.shapes == (S(3, 2, 7), S(2, 1, 3))  # duplicates once


def feed(tracker, tokens: list[int]) -> list:
    return [tracker.observe([t]) for t in tokens]


def test_tracker_moves_to_the_small_shape_when_little_is_accepted_and_stays_when_much_is():
    lad = ShapeLadder.build([BIG, SMALL], acceptance(), costs())
    low = lad.track(BIG)
    got = feed(low, [1, 1])
    assert got == [None, None] and low.spec == BIG  # no switch before MIN_ROUNDS
    got = feed(low, [1, 1, 1])
    assert SMALL in got and low.spec == SMALL and got.count(SMALL) == 1
    high = lad.track(BIG)
    assert feed(high, [5] * 20) == [None] * 20 and high.spec == BIG
    # and back: a request that starts small but is accepted deep moves to the deep tree
    up = lad.track(SMALL)
    assert BIG in feed(up, [3] * 10) and up.spec == BIG


def test_tracker_estimate_follows_the_observed_acceptance():
    lad = ShapeLadder.build([BIG, SMALL], acceptance(), costs())
    js = []
    for a in (1, 2, 3, 4):
        t = lad.track(BIG)
        t.rounds = -100  # observe only, never switch
        feed(t, [a] * 12)
        js.append(t.estimate())
    assert js == sorted(js) and js[0] < js[-1]  # more accepted, larger λ̂
    t = lad.track(BIG)
    j = 20  # rounds exactly as predicted at LAMBDAS[j] give λ̂ = LAMBDAS[j]
    t.rounds = -100
    for _ in range(10):
        t.observe([lad.tau[0][j]])
    assert abs(t.estimate() - j) <= 1


def test_a_ladder_waits_its_min_rounds_before_the_first_switch():
    """Rounds that accept nothing move a request to the small shape at round ``min_rounds``, not before."""
    lad = ShapeLadder.build([BIG, SMALL], acceptance(), costs())
    for wait in (MIN_ROUNDS, LONG_MIN_ROUNDS):
        moves = feed(replace(lad, min_rounds=wait).track(BIG), [1] * 12)
        assert moves.index(SMALL) == wait - 1 and moves.count(None) == 11


def test_tracker_never_flaps_within_the_margin():
    # two shapes predicted within MARGIN of each other at every λ: no switch whatever is observed
    lad = ShapeLadder(
        (BIG, SMALL),
        ((2.0,) * len(LAMBDAS), (2.0,) * len(LAMBDAS)),
        (1.0, 1.0 / (1 + ad.MARGIN / 2)),
        (1,) * len(LAMBDAS),
    )
    t = lad.track(BIG)
    assert feed(t, [1, 5, 1, 5, 2, 3] * 3) == [None] * 18


# ------------------------------------------------------------------ profiles
def _row(spec: S, rates: dict[str, float], **kw) -> dict:
    return {"batch_size": 1, "sampling": "greedy", "spec": prof._spec_fields(spec), "decode_tokens_per_s": rates, **kw}


def _data(rows: list[dict], with_model: bool = True) -> dict:
    d = {"kind": prof.KIND, "spec": prof._spec_fields(BIG), "shapes": rows}
    if with_model:
        d |= {"costs": asdict(costs()), "acceptance": asdict(acceptance())}
    return d


def test_a_profile_row_carries_its_measured_shapes_with_its_lookup():
    chosen = S(4, 2, 9, prompt_lookup_num_tokens=4)
    rates = {"plain": 10.0, "(4,2,9)": 20.0, "(2,1,3)": 18.0, "(1,1,2)": 13.0, "(5,1,6)": 9.0, "bogus": 30.0}
    policy = prof.policy_from_profile(_data([_row(chosen, rates), _row(SMALL, rates, context=50)]), "profile", "cpu")
    c = policy.choose(1, True)
    assert c.spec == chosen and c.ladder is not None
    # >= 0.7 x the best and faster than plain: (1,1,2) at 0.65x and (5,1,6) below plain are left out
    assert [s.label for s in c.ladder.shapes] == ["(4,2,9)+lookup4", "(2,1,3)+lookup4"]
    assert policy.choose(1, False).ladder is None and policy.choose(4, True).ladder is None
    assert policy.largest(4).num_draft_tokens >= 9  # the caches fit every ladder shape


def test_a_long_context_row_has_a_ladder_of_its_own_rates():
    """The batch-1 greedy row measured on long prompts gets its own ladder: its shape and the shapes its
    own table measured (not the short row's); its batch-4 row and its sampled row keep their shape, and
    a long row where plain decoding won has none. The caches fit the long ladder's shapes too."""
    short = {"plain": 10.0, "(2,1,3)": 20.0, "(1,1,2)": 18.0}
    long = {"plain": 5.0, "(4,1,5)": 12.0, "(3,1,4)": 10.0, "(2,1,3)": 4.0}  # (2,1,3) below plain there
    rows = [_row(SMALL, short), _row(S(4, 1, 5), long, context=50), _row(SMALL, long, context=50, batch_size=4)]
    policy = prof.policy_from_profile(_data(rows), "profile", "cpu")
    c = policy.choose(1, True, context=60)
    assert c.spec == S(4, 1, 5) and c.source == "profile, context >= 50"
    assert c.ladder is not None and [s.label for s in c.ladder.shapes] == ["(4,1,5)", "(3,1,4)"]
    assert [s.label for s in policy.choose(1, True).ladder.shapes] == ["(2,1,3)", "(1,1,2)"]
    assert c.ladder.min_rounds == LONG_MIN_ROUNDS > policy.choose(1, True).ladder.min_rounds == MIN_ROUNDS
    assert policy.choose(4, True, context=60).ladder is None and policy.choose(1, False, context=60).ladder is None
    assert policy.largest(1).num_speculative_tokens >= 4
    plain = prof.policy_from_profile(
        _data([_row(SMALL, short), {**_row(SMALL, long, context=50), "spec": None}]), "p", "cpu"
    )
    assert plain.choose(1, True, context=60).spec is None and plain.choose(1, True, context=60).ladder is None


def test_a_row_whose_pick_is_not_the_fastest_bare_shape_keeps_it_fixed():
    """A row that chose (2,1,3) + lookup 4 while bare (4,2,9) measured faster: the ladder, which compares
    bare rates, would move a request accepted exactly as predicted off the tuned pick, so the row gets none;
    the inverse: the same rates with (4,2,9) + lookup 4 chosen keep a ladder."""
    rates = {"plain": 10.0, "(4,2,9)": 20.0, "(2,1,3)": 18.0}
    lookup = dict(prompt_lookup_num_tokens=4)
    slow = prof.policy_from_profile(_data([_row(S(2, 1, 3, **lookup), rates)]), "profile", "cpu")
    assert slow.choose(1, True).spec == S(2, 1, 3, **lookup) and slow.choose(1, True).ladder is None
    fast = prof.policy_from_profile(_data([_row(S(4, 2, 9, **lookup), rates)]), "profile", "cpu")
    assert fast.choose(1, True).ladder is not None


def _zero_costs(d: dict) -> None:  # an unmeasured chosen shape on a zero cost model: no round time
    d["costs"].update(verify_s=[0.0] * 5, draft_head_s={1: 0.0, 2: 0.0}, draft_step_s={1: 0.0, 2: 0.0})
    d["costs"].update(commit_s=[0.0, 0.0], plain_s=0.0)
    d["shapes"][0]["decode_tokens_per_s"]["(4,2,9)"] = 0.0


@pytest.mark.parametrize(
    "break_it",
    [
        lambda d: d["costs"].update(verify_s="fast"),
        lambda d: d["costs"].update(verify_n=[1, 2, 2, 8, 16]),  # not increasing: no interpolation
        _zero_costs,
        lambda d: d["shapes"][0].update(decode_tokens_per_s=[20.0, 18.0]),
        lambda d: d["acceptance"].update(p="high"),
    ],
    ids=["verify_s", "verify_n", "zero-costs", "rates-list", "acceptance"],
)
def test_a_malformed_ladder_warns_and_the_profile_still_applies(break_it):
    data = _data([_row(BIG, {"plain": 10.0, "(4,2,9)": 20.0, "(2,1,3)": 18.0})])
    break_it(data)
    with pytest.warns(Warning, match="malformed"):
        p = prof.policy_from_profile(data, "profile", "cpu")
    assert p.choose(1, True).spec == BIG and p.choose(1, True).ladder is None


def test_older_or_broken_profiles_keep_their_shape_fixed():
    rates = {"plain": 10.0, "(4,2,9)": 20.0, "(2,1,3)": 18.0}
    old = prof.policy_from_profile(_data([_row(BIG, rates)], with_model=False), "profile", "cpu")
    assert old.choose(1, True).spec == BIG and old.choose(1, True).ladder is None
    broken = _data([_row(BIG, rates)])
    broken["costs"] = dict(broken["costs"], verify_s="fast")
    with pytest.warns(Warning, match="costs, acceptance or measured rates are malformed"):
        p = prof.policy_from_profile(broken, "profile", "cpu")
    assert p.choose(1, True).spec == BIG and p.choose(1, True).ladder is None


# ------------------------------------------------------------------ end to end
@pytest.fixture
def pair_with_profile(tuned_dir):
    """perm_pair with a user profile whose batch-1 greedy row measured BIG (chosen) and SMALL."""
    model, drafter = perm_pair("llama", vocab=24, seed=3, alpha=0.3)
    rt0 = runtime(model, drafter)
    key = dict(
        target=prof.target_fingerprint(rt0.target),
        drafter=prof.drafter_fingerprint(drafter),
        device=prof.device_key("cpu"),
        dtype="float32",
        backend="torch",
    )
    row = {"batch_size": 1, "sampling": "greedy", "spec": BIG, "decode_tokens_per_s": {"(4,2,9)": 2.0, "(2,1,3)": 1.9}}
    prof.write_profile(
        tuned_dir,
        key,
        BIG,
        predicted={},
        measured_with={},
        costs=asdict(costs()),
        acceptance=asdict(acceptance()),
        checks=[],
        shapes=[row],
    )
    return model, drafter


def forced(rt, to: S) -> None:
    """Replace the runtime's batch-1 greedy ladder by one that always prefers ``to`` (2x its rate)."""
    start = rt.shape_policy.choose(1, True).spec
    n = len(LAMBDAS)
    rt.shape_policy.ladders[1, "greedy"] = ShapeLadder((start, to), ((2.0,) * n, (2.0,) * n), (1.0, 0.5), (1,) * n)


def test_a_request_switches_shape_and_keeps_the_targets_tokens(pair_with_profile):
    model, drafter = pair_with_profile
    rt = runtime(model, drafter, max_batch_size=2)
    assert rt.shape_policy.source == "profile" and rt.shape_policy.choose(1, True).ladder is not None
    prompt = random_prompts(24, [6], seed=4)
    plain = rt.generate(prompt, max_new_tokens=30, speculative=False).token_ids
    forced(rt, SMALL)
    out = rt.generate(prompt, max_new_tokens=30)
    s = out.stats
    assert out.token_ids == plain
    assert s.shape_switches == 1 and s.spec == BIG  # stats.spec: the shape it started with
    assert s.rounds_per_shape[BIG.label] == ad.MIN_ROUNDS and s.rounds_per_shape[SMALL.label] >= 1
    assert sum(s.rounds_per_shape.values()) == s.num_drafts
    assert len(s.accepted_per_position) == BIG.tree_depth
    assert rt.spec == BIG  # the shape the request started with, not the one it ended on
    # the inverse: adaptive_shape=False, sampling, or two rows keep the shape
    fixed = runtime(model, drafter, max_batch_size=2, adaptive_shape=False)
    forced(fixed, SMALL)
    f = fixed.generate(prompt, max_new_tokens=30)
    assert f.token_ids == plain and f.stats.shape_switches == 0 and list(f.stats.rounds_per_shape) == [BIG.label]
    sampled = rt.generate(prompt, max_new_tokens=30, temperature=1.0, seed=3)
    assert sampled.stats.shape_switches == 0
    two = rt.generate(prompt * 2, max_new_tokens=12)
    assert two.stats.shape_switches == 0


def test_a_long_prompt_switches_by_its_context_rows_ladder_after_its_min_rounds(pair_with_profile):
    """End to end: a prompt at least a long-context row's threshold long takes that row's ladder (not the
    short row's), switches only after the ladder's ``min_rounds``, and keeps the target's tokens."""
    from tritonspec.runtime.spec_policy import ShapePolicy

    model, drafter = pair_with_profile
    rt = runtime(model, drafter, max_batch_size=2)
    forced(rt, SMALL)  # the short row's ladder would switch after MIN_ROUNDS
    n = len(LAMBDAS)
    lad = ShapeLadder((BIG, SMALL), ((2.0,) * n, (2.0,) * n), (1.0, 0.5), (1,) * n, min_rounds=LONG_MIN_ROUNDS)
    long_row = ShapePolicy("profile", BIG.num_draft_tokens, "cpu", {(1, "greedy"): BIG}, ladders={(1, "greedy"): lad})
    rt.shape_policy.contexts[10] = long_row
    prompt = random_prompts(24, [12], seed=4)
    plain = rt.generate(prompt, max_new_tokens=80, speculative=False).token_ids
    out = rt.generate(prompt, max_new_tokens=80)
    s = out.stats
    assert out.token_ids == plain and s.spec_source == "profile, context >= 10"
    assert s.shape_switches == 1 and s.rounds_per_shape[BIG.label] == LONG_MIN_ROUNDS
    assert s.rounds_per_shape[SMALL.label] >= 1


def test_each_request_of_a_one_row_queue_starts_from_the_profile_shape(pair_with_profile):
    model, drafter = pair_with_profile
    rt = runtime(model, drafter, max_batch_size=1)
    prompts = random_prompts(24, [5, 7, 4], seed=6)
    plain = rt.generate(prompts, max_new_tokens=16, speculative=False).token_ids
    forced(rt, SMALL)
    out = rt.generate(prompts, max_new_tokens=16)
    assert out.token_ids == plain
    assert out.stats.shape_switches == 3  # one per request: the tracker restarts on each admitted prompt
    assert out.stats.rounds_per_shape[BIG.label] == 3 * ad.MIN_ROUNDS


def test_a_ladder_shape_larger_than_the_caches_is_fitted_before_the_prefill(pair_with_profile):
    model, drafter = pair_with_profile
    rt = runtime(model, drafter, max_batch_size=1)
    prompt = random_prompts(24, [6], seed=5)
    plain = rt.generate(prompt, max_new_tokens=30, speculative=False).token_ids
    deep = S(7, 2, 15, prompt_lookup_num_tokens=8)  # deeper and wider than anything the policy picked
    forced(rt, deep)
    out = rt.generate(prompt, max_new_tokens=30)
    assert out.token_ids == plain and out.stats.rounds_per_shape.get(deep.label, 0) >= 1
    assert len(out.stats.accepted_per_position) == deep.tree_depth


def test_cli_flag_turns_it_off_and_the_stats_line_lists_the_shapes(capsys, monkeypatch):
    from tritonspec.cli import main
    from tritonspec.runtime.spec_policy import ShapePolicy

    real = ts.SpeculativeRuntime.from_pretrained
    built = []

    def with_ladder(*a, **kw):  # the demo pair under a profile policy whose ladder always prefers SMALL
        rt = real(*a, **kw)
        rt._policy = ShapePolicy("profile", BIG.num_draft_tokens, table={(1, "greedy"): BIG})
        forced(rt, SMALL)
        built.append(rt)
        return rt

    monkeypatch.setattr(ts.SpeculativeRuntime, "from_pretrained", with_ladder)
    args = ["generate", "def f(x):", "--target", "demo", "--max-new-tokens", "24"]
    assert main(args) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"shapes={BIG.label}:{ad.MIN_ROUNDS},{SMALL.label}:" in line and built[-1].adaptive_shape is True
    assert main([*args, "--no-adaptive-shape"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "shapes=" not in line and built[-1].adaptive_shape is False


def test_adaptive_shape_must_be_a_bool():
    model, drafter = perm_pair("llama", vocab=24, seed=3)
    with pytest.raises(ts.UserError, match="adaptive_shape"):
        runtime(model, drafter, adaptive_shape="yes")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert runtime(model, drafter, adaptive_shape=False).adaptive_shape is False


def test_observed_decoding_keeps_its_shape(pair_with_profile):
    """A drift observer records one shape's depths: its requests never switch (the inverse of the
    forced switch above, on the same runtime)."""
    from tritonspec.runtime.drift import DriftRecorder

    model, drafter = pair_with_profile
    rt = runtime(model, drafter, max_batch_size=1)
    prompt = random_prompts(24, [6], seed=4)
    forced(rt, SMALL)
    with rt.observe(DriftRecorder(BIG.tree_depth)):
        seen = rt.generate(prompt, max_new_tokens=20)
    assert seen.stats.shape_switches == 0 and list(seen.stats.rounds_per_shape) == [BIG.label]
    assert rt.generate(prompt, max_new_tokens=20).stats.shape_switches == 1


def test_compiled_rounds_keep_their_shape(pair_with_profile):
    """A compiled round is one artefact per shape: such runtimes never adapt (checked without compiling)."""
    from tritonspec.runtime.sampling import SamplingParams

    model, drafter = pair_with_profile
    greedy = SamplingParams()
    assert runtime(model, drafter, max_batch_size=1)._adapts(greedy)
    compiled = runtime(model, drafter, max_batch_size=1, compile=True)
    assert compiled.compiled and not compiled._adapts(greedy)
    assert not runtime(model, drafter, max_batch_size=1, adaptive_shape=False)._adapts(greedy)
    assert runtime(model, drafter, max_batch_size=2)._adapts(greedy)  # by the rows it runs (test_rows_shape.py)
    assert not runtime(model, drafter, max_batch_size=1)._adapts(SamplingParams(temperature=1.0))


@pytest.mark.parametrize("path", sorted(prof.SHIPPED_DIR.glob("tree_shape,*.json")), ids=lambda p: p.name[:60])
def test_a_request_accepted_as_the_profile_predicts_keeps_the_tuned_shape(path):
    """Calibrated by the measured rates, every shipped ladder ranks the tuned shape first at λ = 1:
    rounds exactly as the profile predicts never move a request off it; rounds far below or above do
    move it (the inverse: the ladder is not inert)."""
    policy = prof.policy_from_profile(prof.read_profile(path), "shipped profile", "cpu")
    choices = [policy.choose(1, True, context) for context in (0, *policy.contexts)]  # the long rows' too
    choices = [c for c in choices if c.ladder is not None]
    if not choices:
        pytest.skip(f"{path.name}: no ladder (no measured shapes, costs or acceptance)")
    for choice in choices:
        _keeps_the_tuned_shape_at_lambda_1(choice)


def _keeps_the_tuned_shape_at_lambda_1(choice) -> None:
    lad = choice.ladder
    i, j1 = lad.shapes.index(choice.spec), LAMBDAS.index(1.0)
    assert lad.best[j1] == i
    t = lad.track(choice.spec)
    assert feed(t, [lad.tau[i][j1]] * 30) == [None] * 30
    moved = {lad.best[0], lad.best[-1]} - {i}
    if moved:  # some λ prefers another shape: rounds at that λ's prediction move the request
        low, high = lad.track(choice.spec), lad.track(choice.spec)
        assert any(feed(low, [lad.tau[i][0]] * 30)) or any(feed(high, [lad.tau[i][-1]] * 30))


def test_the_tracker_sees_the_drafter_nodes_each_running_round_accepted(pair_with_profile, monkeypatch):
    """Without a lookup branch every round but the request's last (its row has finished) feeds the
    tracker 1 + the drafter nodes it accepted: the tokens the round emitted."""
    model, drafter = pair_with_profile
    rt = runtime(model, drafter, max_batch_size=1)
    seen, emitted = [], []
    real_observe, real_collect = ad.ShapeTracker.observe, rt.decoder.collect

    def observe(self, tokens):
        seen.append(list(tokens))
        return real_observe(self, tokens)

    def collect():
        new = real_collect()
        emitted.append([len(t) for t in new if t])
        return new

    monkeypatch.setattr(ad.ShapeTracker, "observe", observe)
    monkeypatch.setattr(rt.decoder, "collect", collect)
    out = rt.generate(random_prompts(24, [6], seed=4), max_new_tokens=25)
    assert out.stats.num_drafts == len(emitted) >= 3
    assert seen[:-1] == emitted[:-1] and seen[-1] == []  # the last round's row had finished
    assert sum(map(sum, emitted)) == out.stats.num_accepted_tokens + out.stats.num_drafts


def test_rounds_the_lookup_branch_carried_further_say_nothing_of_the_drafter(tuned_dir, monkeypatch):
    """A target whose greedy text soon repeats, a random drafter, a 4-token lookup branch: the lookup
    carries many rounds past the drafter's tree; those rounds are left out of the fit (the drafter's
    tree alone would have accepted less), so they never read as deep acceptance."""
    from tritonspec.runtime.spec_policy import ShapePolicy

    model, _ = perm_pair("llama", vocab=24, seed=3, alpha=0.3, chain=[3, 5, 7, 9])
    bad = ts.Eagle3Drafter.for_target(model.config, seed=11)
    rt = runtime(model, bad, max_batch_size=1)
    start = S(2, 1, 3, prompt_lookup_num_tokens=4)
    rt._policy = ShapePolicy("profile", 3, table={(1, "greedy"): start})
    n = len(LAMBDAS)
    rt.shape_policy.ladders[1, "greedy"] = ShapeLadder(
        (start, S(4, 1, 5, prompt_lookup_num_tokens=4)), (LAMBDAS, LAMBDAS), (1.0, 1.0), (0,) * n
    )
    seen = []
    real = ad.ShapeTracker.observe
    monkeypatch.setattr(
        ad.ShapeTracker, "observe", lambda self, tokens: seen.append(list(tokens)) or real(self, tokens)
    )
    out = rt.generate([[3, 5, 7, 9, 3, 5, 7, 9, 3]], max_new_tokens=40)
    assert out.token_ids == rt.generate([[3, 5, 7, 9, 3, 5, 7, 9, 3]], max_new_tokens=40, speculative=False).token_ids
    assert out.stats.mean_acceptance_length > 1.5  # the lookup branch carries rounds (8 of 21 here)
    assert sum(1 for s in seen if not s) >= 5  # those rounds said nothing of the drafter
    assert all(t <= 2 for s in seen for t in s)  # the random drafter's own tree: hardly ever accepted


def test_a_stream_closed_after_a_switch_leaves_the_runtime_on_the_profile_shape(pair_with_profile):
    model, drafter = pair_with_profile
    rt = runtime(model, drafter, max_batch_size=1)
    prompt = random_prompts(24, [6], seed=4)
    forced(rt, SMALL)
    stream = rt.stream(prompt[0], max_new_tokens=40)
    for i, _ in enumerate(stream):
        if i == ad.MIN_ROUNDS + 2:  # past the switch
            break
    assert rt.spec == SMALL  # the open stream's next round
    stream.close()
    assert rt.spec == BIG  # closed: back to the shape requests start from
    again = rt.generate(prompt, max_new_tokens=30)
    assert again.stats.shape_switches == 1 and again.stats.rounds_per_shape[BIG.label] == ad.MIN_ROUNDS


def test_deterministic_mode_switches_shape_and_keeps_its_tokens(pair_with_profile):
    model, drafter = pair_with_profile
    rt = runtime(model, drafter, max_batch_size=1, deterministic=True)
    prompt = random_prompts(24, [6], seed=7)
    plain = rt.generate(prompt, max_new_tokens=30, speculative=False).token_ids
    forced(rt, SMALL)
    out = rt.generate(prompt, max_new_tokens=30)
    assert out.stats.shape_switches == 1 and out.token_ids == plain
