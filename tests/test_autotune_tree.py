"""The tree-shape tuner: the acceptance model by hand, the known optimum on synthetic cost and
acceptance models, and an end-to-end run on the CPU with a tiny target + drafter whose profile
``SpeculativeRuntime(spec=None)`` then uses."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

import tritonspec as ts
from tritonspec.autotune import tree_tuner
from tritonspec.autotune.tree_model import AcceptanceProfile, CostModel, _monotone, neighbours, predict, search
from tritonspec.autotune.tree_tuner import tune_tree
from tritonspec.kernels import store
from tritonspec.runtime.profiles import candidate_profiles, shape_policy
from tritonspec.runtime.spec_policy import ROW_BUDGET, rule_shape

from _util import perm_pair, random_prompts, runtime


def _costs(verify, head=lambda k: 0.0, step=lambda k: 0.0, commit=(0.0, 0.0), plain=1.0, ks=(1, 2, 4, 8)):
    ns = list(range(1, 129))
    return CostModel(ns, [verify(n) for n in ns], {k: head(k) for k in ks}, {k: step(k) for k in ks}, commit, plain)


def test_profile_from_ranks():
    ranks = torch.tensor([[0, 1], [0, -1], [1, 0], [-1, -2]])
    acc = AcceptanceProfile.from_ranks(ranks, max_rank=2)
    assert acc.p[0] == [0.5, 0.25] and acc.samples == [4, 3]
    assert acc.p[1] == pytest.approx([1 / 3, 1 / 3])  # rows reachable at depth 2: 0, 1, 2


def test_tokens_per_round_by_hand():
    acc = AcceptanceProfile([[0.5, 0.3], [0.6, 0.2], [0.5, 0.5]])
    # depth 2, top_k 2: level 1 {.5, .3}; level 2 {.30, .10, .18, .06}; rerank keeps the best N-1
    assert acc.tokens_per_round(2, 2) == pytest.approx([1, 1.5, 1.8, 2.1, 2.28, 2.38, 2.44])
    # depth 3: only the best 2 of level 2 (.30, .18) expand, each with children .5/.5 of it
    assert sorted(acc.candidate_probs(3, 2)[6:]) == pytest.approx(sorted([0.15, 0.15, 0.09, 0.09]))
    assert acc.tokens_per_round(1, 1) == [1, 1.5]


def test_tree_is_chosen_by_drafter_scores_but_valued_by_acceptance():
    """An under-confident drafter (deep right answers scored below a shallow sibling) gets the
    shallow sibling in its tree, as EAGLE-2's rerank does at run time: the value counts P only."""
    import math

    p = [[0.8, 0.1], [0.8, 0.1]]
    confident = AcceptanceProfile(p)
    shy = AcceptanceProfile(p, score=[[math.log(0.5), math.log(0.4)], [math.log(0.3), math.log(0.3)]])
    assert confident.tokens_per_round(2, 2)[2] == pytest.approx(1 + 0.8 + 0.64)  # root's child, then its child
    assert shy.tokens_per_round(2, 2)[2] == pytest.approx(1 + 0.8 + 0.1)  # the rank-1 sibling outranks depth 2
    assert shy.tokens_per_round(2, 2)[-1] == pytest.approx(confident.tokens_per_round(2, 2)[-1])  # same nodes at N max


def test_picks_the_known_chain_optimum():
    """Only the drafter's top-1 is ever right (p = 0.8 per depth), verify costs the same for any N:
    the best shape is a chain (top_k 1, N = D + 1) whose depth maximises (1 + sum 0.8^i) / time."""
    p = [[0.8] + [0.0] * 7 for _ in range(10)]
    acc = AcceptanceProfile(p)
    costs = _costs(lambda n: 1.0, head=lambda k: 0.05 * k, step=lambda k: 0.1 + 0.05 * k, commit=(0.05, 0.01))

    def rate(D):  # the same model written out for a chain
        return (1 + sum(0.8**i for i in range(1, D + 1))) / (0.05 + (D - 1) * 0.15 + 1.0 + 0.05 + 0.01 * D)

    best_d = max(range(1, 11), key=rate)
    best = search(costs, acc, max_depth=10)[0]
    assert (best.spec.num_speculative_tokens, best.spec.top_k, best.spec.num_draft_tokens) == (best_d, 1, best_d + 1)
    assert best.speedup == pytest.approx(rate(best_d))
    assert 2 < best_d < 10  # an interior optimum, not an edge of the grid


def test_picks_the_verify_knee():
    """A GPU-like verify cost, flat up to 16 tree tokens then steep: the best N is the knee."""
    acc = AcceptanceProfile([[0.6 * 0.5**r for r in range(8)] for _ in range(8)])
    costs = _costs(lambda n: 1.0 if n <= 16 else 1.0 + 0.1 * (n - 16), head=lambda k: 0.01, step=lambda k: 0.01)
    ranked = search(costs, acc)
    assert ranked[0].spec.num_draft_tokens == 16
    assert ranked[0].tokens_per_second >= max(r.tokens_per_second for r in ranked)
    assert all(r.spec.num_draft_tokens - 1 >= r.spec.num_speculative_tokens for r in ranked)


def test_neighbours_and_monotone_verify():
    acc = AcceptanceProfile([[0.6 * 0.5**r for r in range(8)] for _ in range(8)])
    costs = _costs(lambda n: 1.0 + 0.02 * n, step=lambda k: 0.05 * k)
    ranked = search(costs, acc)
    best = ranked[0].spec
    nb = neighbours(best, ranked)
    assert len(nb) == 2 and all(n.spec != best for n in nb)
    assert predict(best, costs, acc) == ranked[0]
    assert _monotone([3.0, 1.0, 2.0, 5.0, 4.0]) == [2.0, 2.0, 2.0, 4.5, 4.5]


def test_end_to_end_on_cpu_then_used_by_the_runtime(tuned_dir):
    model, drafter = perm_pair("llama", vocab=24, seed=0, alpha=0.3)
    prompts = random_prompts(24, [5, 7, 6], seed=1)
    res = tune_tree(
        model,
        drafter,
        prompts,
        max_new_tokens=16,
        max_depth=3,
        top_ks=(1, 2),
        max_draft_tokens=12,
        reps=2,
        out_dir=tuned_dir,
    )
    assert res.profile_path is not None and res.profile_path.parent == tuned_dir
    assert res.profile_path.name.startswith("tree_shape,target=") and ",backend=torch.json" in res.profile_path.name
    data = json.loads(res.profile_path.read_text())
    assert data["spec"] == {
        "num_speculative_tokens": res.best.spec.num_speculative_tokens,
        "top_k": res.best.spec.top_k,
        "num_draft_tokens": res.best.spec.num_draft_tokens,
    }
    assert data["versions"]["torch"] and data["device_name"].startswith("cpu-") and data["acceptance"]["p"]
    assert res.n_roots >= 10 and 0 < res.acceptance.p[0][0] <= 1
    roles = [c.role for c in res.checks]
    assert roles[0] == "chosen" and roles.count("neighbour") == 2
    for c in res.checks:
        assert c.measured_tau >= 1 and c.measured_speedup > 0 and c.predicted_speedup > 0
    assert "chosen" in res.table() and "plain decoding" in res.table()

    rt = runtime(model, drafter, spec=None)  # the tuned profile for this pair and device
    choice = rt.shape_policy.choose(1, True)
    slower = res.checks[0].measured_speedup < 1  # measured slower than plain: the profile says plain at batch 1
    assert choice.source == "profile" and choice.spec == (None if slower else res.best.spec)
    assert data["spec"] and (data["shapes"] == [] if not slower else data["shapes"][0]["spec"] is None)
    out = rt.generate(prompts[:1], max_new_tokens=8)
    assert out.token_ids == rt.generate(prompts[:1], max_new_tokens=8, speculative=False).token_ids
    assert runtime(model, drafter, spec=ts.SpecConfig.chain(2)).spec == ts.SpecConfig.chain(2)  # explicit wins
    _, other = perm_pair("llama", vocab=24, seed=1, alpha=0.3)  # another drafter: no profile, the rule
    assert runtime(model, other, spec=None).shape_policy.source == "heuristic"
    assert runtime(model, other, spec=None).spec == rule_shape(1, True, ROW_BUDGET["cpu"])

    res.profile_path.write_text("{broken")
    with pytest.warns(store.TunedConfigWarning, match="ignoring the tuned tree profile"):
        assert runtime(model, drafter, spec=None).shape_policy.source == "heuristic"


def test_no_profile_is_silent_and_plain_runtime_needs_none(tuned_dir):
    model, drafter = perm_pair("llama", vocab=24, seed=0, alpha=0.3)
    tm = ts.TargetModel.from_pretrained(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", store.TunedConfigWarning)
        assert candidate_profiles(tm, drafter, "torch") == []
        assert shape_policy(tm, drafter, "torch").source == "heuristic"
        assert shape_policy(tm, None, "torch").source == "heuristic"


def test_cli_tree_on_a_tiny_pair(tmp_path, tuned_dir, capsys):
    from tritonspec.cli import main
    from tritonspec.runtime.tiny import tiny_random_pair

    t, d = tiny_random_pair(tmp_path / "pair")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": 1, "prompt": "def f(x):"}\n{"id": 2, "prompt": "import os"}\n')
    argv = [
        "autotune",
        "tree",
        "--target",
        str(t),
        "--drafter",
        str(d),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "8",
        "--max-depth",
        "2",
        "--top-k",
        "1,2",
        "--max-draft-tokens",
        "6",
    ]
    assert main(argv + ["--dry-run", "--no-validate"]) == 0
    out = capsys.readouterr().out
    assert "chosen: num_speculative_tokens=" in out and "dry run: nothing written" in out and not tuned_dir.exists()
    assert main(argv + ["--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "meas speedup" in out and "plain decoding" in out and "wrote " in out
    assert len(list((tmp_path / "o").glob("tree_shape,*.json"))) == 1


def test_teacher_forced_profile_predicts_chain_acceptance():
    """For a chain the model has no tree-selection assumption left: the teacher-forced profile must
    predict the runtime's measured acceptance length (a check on the forced drafting itself)."""
    from tritonspec.autotune.tree_measure import measure_generation

    model, drafter = perm_pair("llama", vocab=24, seed=0, alpha=0.3, chain=[3, 7, 11, 5, 9])
    prompts = random_prompts(24, [5, 7, 6, 8], seed=1)
    res = tune_tree(
        model,
        drafter,
        prompts,
        max_new_tokens=24,
        max_depth=3,
        top_ks=(1,),
        max_draft_tokens=4,
        reps=1,
        dry_run=True,
        validate=False,
    )
    assert res.profile_path is None  # dry run
    rt = runtime(model, drafter, spec=ts.SpecConfig.chain(3), max_batch_size=1)
    for k in (1, 3):
        spec = ts.SpecConfig.chain(k)
        measured = measure_generation(rt, prompts, 24, [spec])[0].tau
        # roots are sampled every other token, rounds start wherever acceptance leaves them: close, not equal
        assert predict(spec, res.costs, res.acceptance).tokens_per_round == pytest.approx(measured, abs=0.12)


def test_string_prompts_without_a_tokenizer_are_a_clear_error():
    model, drafter = perm_pair("llama", vocab=24, seed=1)  # a loaded model: no tokenizer to read
    with pytest.raises(ValueError, match="string prompts need the target's tokenizer"):
        tune_tree(
            model, drafter, ["def f(x):"], max_new_tokens=4, max_depth=2, top_ks=(1,), max_draft_tokens=3, dry_run=True
        )


def test_measure_generation_repeats_alternate_the_order():
    """``repeats=2`` runs every batch twice, shapes in order then reversed, and sums both passes
    (the per-prompt first tokens too, so decode tokens/s stays a rate)."""
    from tritonspec.autotune import tree_measure

    model, drafter = perm_pair("llama", vocab=24, seed=0, alpha=0.3, chain=[3, 7, 11, 5, 9])
    prompts = random_prompts(24, [5, 7], seed=1)
    rt = runtime(model, drafter, spec=ts.SpecConfig.chain(2), max_batch_size=1)
    specs = [None, ts.SpecConfig.chain(1), ts.SpecConfig.chain(2)]
    calls = []
    real = rt.generate

    def spy(*a, **kw):
        calls.append(rt.spec.num_speculative_tokens if kw["speculative"] else 0)
        return real(*a, **kw)

    rt.generate = spy
    once = tree_measure.measure_generation(rt, prompts, 6, specs)
    calls.clear()
    twice = tree_measure.measure_generation(rt, prompts, 6, specs, repeats=2)
    # 3 untimed warm-ups, then pass 1 (A B C per prompt), then pass 2 (C B A per prompt)
    assert calls == [0, 1, 2] + [0, 1, 2] * 2 + [2, 1, 0] * 2
    for a, b in zip(once, twice):
        assert b.tokens == 2 * a.tokens and b.n_prompts == 2 * a.n_prompts and b.rounds == 2 * a.rounds
        assert b.token_ids == a.token_ids * 2
    with pytest.raises(ValueError, match="repeats=0"):
        tree_measure.measure_generation(rt, prompts, 6, specs, repeats=0)


def test_candidates_for_compiled_rounds_run_deeper_chains():
    big = ts.SpecConfig(8, 2, 16)
    chains = lambda cands: sorted(s.num_speculative_tokens for s in cands if s.top_k == 1)  # noqa: E731
    eager = tree_tuner.candidates_at(1, True, ts.SpecConfig(3, 2, 7), big)
    compiled = tree_tuner.candidates_at(1, True, ts.SpecConfig(3, 2, 7), big, compiled=True)
    assert {1, 2, 4} <= set(chains(eager)) and 6 not in chains(eager)
    assert {2, 4, 6} <= set(chains(compiled)) and 1 not in chains(compiled)
    sampled = tree_tuner.candidates_at(1, False, ts.SpecConfig(3, 2, 7), big)  # deeper sampled chains too
    assert {1, 2, 4, 6} <= set(chains(sampled)) and all(s.top_k == 1 for s in sampled)
    assert 6 not in chains(tree_tuner.candidates_at(1, False, ts.SpecConfig(3, 2, 7), ts.SpecConfig(4, 2, 9)))


def test_compiled_rounds_tune_into_their_own_profile(tuned_dir, monkeypatch):
    """``compile=True``: shapes measured with compiled rounds, a ``rounds=compiled`` profile whose
    batch-1 greedy row a compiled runtime then runs, and which an eager runtime ignores. Compiled
    without the C++ wrapper (what is tested is the tuner's flow; it compiles each key 5x faster)."""
    from tritonspec.runtime import graphs

    monkeypatch.setattr(graphs, "COMPILE_OPTIONS", {})
    seen = []

    def one_candidate(b, greedy, chosen, largest, device_type="cpu", compiled=False):  # two compiles, not five
        seen.append(compiled)
        return [ts.SpecConfig.chain(2)]

    monkeypatch.setattr(tree_tuner, "candidates_at", one_candidate)
    model, drafter = perm_pair("llama", vocab=24, seed=0, alpha=0.3)
    prompts = random_prompts(24, [5, 7], seed=1)
    res = tune_tree(
        model, drafter, prompts, max_new_tokens=8, max_depth=2, top_ks=(1,), max_draft_tokens=3, reps=1,
        out_dir=tuned_dir, validate=False, compile=True,
    )  # fmt: skip
    assert res.profile_path.name.endswith(",backend=torch,rounds=compiled.json")
    data = json.loads(res.profile_path.read_text())
    assert seen == [True] and data["rounds"] == "compiled"
    assert [(r["batch_size"], r["sampling"]) for r in data["shapes"]] == [(1, "greedy")]
    row = data["shapes"][0]["spec"]
    want = ts.SpecConfig(**row) if row else None
    rt = runtime(model, drafter, spec=None, compile=True)
    assert rt.shape_policy.choose(1, True).spec == want and rt.shape_policy.source == "profile (compiled rounds)"
    assert runtime(model, drafter, spec=None).shape_policy.source == "heuristic"  # eager rounds: not theirs


def test_batch_one_greedy_row_also_measures_the_checked_shapes(tuned_dir, monkeypatch):
    """The check pass's neighbours compete in the batch-1 greedy row (a neighbour that measured best
    there must be able to win the row); other rows keep their candidates."""
    monkeypatch.setattr(tree_tuner, "candidates_at", lambda *a, **k: [ts.SpecConfig.chain(1)])
    model, drafter = perm_pair("llama", vocab=24, seed=0, alpha=0.3)
    prompts = random_prompts(24, [5, 7], seed=1)
    res = tune_tree(
        model, drafter, prompts, max_new_tokens=8, max_depth=3, top_ks=(1, 2), max_draft_tokens=8, reps=1,
        out_dir=tuned_dir, batch_sizes=(1, 2),
    )  # fmt: skip
    rows = {(r["batch_size"], r["sampling"]): set(r["decode_tokens_per_s"]) - {"plain"} for r in res.shapes}
    checked = {f"({s.num_speculative_tokens},{s.top_k},{s.num_draft_tokens})" for s in (c.spec for c in res.checks)}
    assert len(checked) >= 3 and rows[1, "greedy"] == {"(1,1,2)"} | checked
    assert rows[2, "greedy"] == {"(1,1,2)"}


def test_row_passes_measure_every_row_that_many_times_and_are_recorded(tuned_dir, monkeypatch):
    """``row_passes=3``: every batch-size row (greedy and sampled) and every lookup pass measures its shapes over
    3 interleaved passes (``measure_generation(repeats=3)``), the profile records it; the default measures rows
    once and lookups twice. Inverse: ``row_passes=0`` is refused."""
    from tritonspec.autotune.tree_measure import Measured

    real = tree_tuner.measure_generation
    seen: list[tuple[int, int]] = []  # (shapes measured besides plain decoding, repeats)

    def rigged(rt, ids, max_new_tokens, specs, batch_size=1, temperature=0.0, repeats=1):
        if specs == [None]:  # the plain baseline: real continuations for the acceptance profile
            return real(rt, ids, max_new_tokens, specs)
        seen.append((len(specs) - 1, repeats))
        rates = [10.0 + (0 if s is None else 1 + s.prompt_lookup_num_tokens) for s in specs]
        return [Measured(100, 100 / r, 0.0, 4, 4, 0) for r in rates]

    monkeypatch.setattr(tree_tuner, "measure_generation", rigged)
    monkeypatch.setattr(tree_tuner, "candidates_at", lambda b, greedy, *a, **k: [ts.SpecConfig.chain(2)])
    model, drafter = perm_pair("llama", vocab=24, seed=0, alpha=0.3)
    kw = dict(max_new_tokens=8, max_depth=2, top_ks=(1,), max_draft_tokens=3, reps=1, out_dir=tuned_dir)
    kw |= dict(validate=False, sampled=True, batch_sizes=(1, 2), prompt_lookup=(3,))
    res = tune_tree(model, drafter, random_prompts(24, [5, 7], seed=1), row_passes=3, **kw)
    assert len(seen) >= 6 and all(r == 3 for _, r in seen)  # 4 rows + 2 greedy lookup passes, all 3 times
    assert json.loads(res.profile_path.read_text())["measured_with"]["row_passes"] == 3
    seen.clear()
    tune_tree(model, drafter, random_prompts(24, [5, 7], seed=1), **kw)
    assert {r for _, r in seen} == {1, 2}  # rows once, the lookup passes twice
    with pytest.raises(ValueError, match="row_passes=0"):
        tune_tree(model, drafter, [[1, 2]], row_passes=0, dry_run=True)


@pytest.mark.parametrize("drafter_pass_s", [0.0, 0.3])
def test_a_row_leaves_plain_decoding_only_when_it_is_faster_end_to_end(tuned_dir, monkeypatch, drafter_pass_s):
    """The plain-or-shape decision of a row compares end-to-end rates: a shape 20% faster on decode whose
    prompts' forward costs more (the drafter's pass over the prompts) than that saves stays plain decoding; the
    same decode rates with an equal forward take the shape. The row records both tables."""
    from tritonspec.autotune.tree_measure import Measured

    real = tree_tuner.measure_generation

    def rigged(rt, ids, max_new_tokens, specs, batch_size=1, temperature=0.0, repeats=1):
        if specs == [None]:
            return real(rt, ids, max_new_tokens, specs)
        # 100 tokens; plain: 1.0 s of prefill + 1.0 s of decoding; the shape: decode 1.2x faster (0.833 s)
        return [
            Measured(100, 2.0, 1.0, 99, 0, 0)
            if sp is None
            else Measured(100, 1.0 + drafter_pass_s + 1 / 1.2, 1.0 + drafter_pass_s, 50, 49, 0)
            for sp in specs
        ]

    monkeypatch.setattr(tree_tuner, "measure_generation", rigged)
    monkeypatch.setattr(tree_tuner, "candidates_at", lambda b, greedy, *a, **k: [ts.SpecConfig.chain(2)])
    model, drafter = perm_pair("llama", vocab=24, seed=0, alpha=0.3)
    res = tune_tree(
        model, drafter, random_prompts(24, [5, 7], seed=1), max_new_tokens=8, max_depth=2, top_ks=(1,),
        max_draft_tokens=3, reps=1, out_dir=tuned_dir, validate=False, batch_sizes=(1, 2),
    )  # fmt: skip
    row = {r["batch_size"]: r for r in res.shapes}[2]
    assert row["decode_tokens_per_s"]["(2,1,3)"] > 1.19 * row["decode_tokens_per_s"]["plain"]  # decode: 1.2x
    assert set(row["tokens_per_s"]) == {"plain", "(2,1,3)"}
    if drafter_pass_s:  # 2.0 s against 2.13 s end to end: plain decoding keeps the row
        assert row["spec"] is None and row["tokens_per_s"]["(2,1,3)"] < row["tokens_per_s"]["plain"]
    else:  # 2.0 s against 1.83 s: 1.09x > the margin
        assert row["spec"] == ts.SpecConfig.chain(2)


def test_prompt_lookup_pass_keeps_the_fastest_and_the_runtime_runs_it(tuned_dir, monkeypatch):
    """``prompt_lookup``: each row's winner is measured with the lookup lengths side by side; the
    fastest is written (with its lookup fields) and ``spec=None`` runs it. Rates are rigged so the
    outcome is known: the longest lookup wins the greedy row; the sampled chain row is left alone."""
    from tritonspec.autotune.tree_measure import Measured

    real = tree_tuner.measure_generation

    def rigged(rt, ids, max_new_tokens, specs, batch_size=1, temperature=0.0, repeats=1):
        if specs == [None]:  # the plain baseline: real continuations for the acceptance profile
            return real(rt, ids, max_new_tokens, specs)
        rates = [10.0 + (0 if s is None else 1 + s.prompt_lookup_num_tokens) for s in specs]
        return [Measured(100, 100 / r, 0.0, 4, 4, 0) for r in rates]

    monkeypatch.setattr(tree_tuner, "measure_generation", rigged)
    monkeypatch.setattr(tree_tuner, "candidates_at", lambda b, greedy, *a, **k: [ts.SpecConfig.chain(2)])
    model, drafter = perm_pair("llama", vocab=24, seed=0, alpha=0.3)
    res = tune_tree(
        model, drafter, random_prompts(24, [5, 7], seed=1), max_new_tokens=8, max_depth=2, top_ks=(1,),
        max_draft_tokens=3, reps=1, out_dir=tuned_dir, validate=False, sampled=True, prompt_lookup=(3, 0, 5),
    )  # fmt: skip
    rows = {(r["batch_size"], r["sampling"]): r for r in res.shapes}
    greedy, sampled = rows[1, "greedy"], rows[1, "sampled"]
    assert greedy["spec"] == ts.SpecConfig(2, 1, 3, prompt_lookup_num_tokens=5)
    assert set(greedy["lookup_decode_tokens_per_s"]) == {"plain", "(2,1,3)", "(2,1,3)+lookup3", "(2,1,3)+lookup5"}
    assert sampled["spec"] == ts.SpecConfig.chain(2) and "lookup_decode_tokens_per_s" not in sampled
    data = json.loads(res.profile_path.read_text())
    assert data["shapes"][0]["spec"]["prompt_lookup_num_tokens"] == 5
    rt = runtime(model, drafter, spec=None)
    assert rt.shape_policy.choose(1, True).spec == greedy["spec"]
    out = rt.generate(random_prompts(24, [6], seed=2), max_new_tokens=12)  # caches sized for the lookup
    assert out.token_ids == rt.generate(random_prompts(24, [6], seed=2), max_new_tokens=12, speculative=False).token_ids
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        tune_tree(model, drafter, [[1, 2]], prompt_lookup=(-1,), dry_run=True)


def test_long_prompts_get_rows_of_their_own_that_the_runtime_runs_on_long_prompts(tuned_dir, monkeypatch):
    """``long_prompts``: the batch-1 rows measured again on long prompts are written with a
    ``context`` threshold (the geometric mean of both sets' median lengths) and the runtime runs them
    for prompts that long, the base rows below. Rates are rigged so the outcome is known: a deep
    chain wins on short prompts, a one-token chain on long ones (as on SmolLM2 / AVX2)."""
    from tritonspec.autotune.tree_measure import Measured

    real = tree_tuner.measure_generation

    def rigged(rt, ids, max_new_tokens, specs, batch_size=1, temperature=0.0, repeats=1):
        if specs == [None]:  # the plain baseline: real continuations for the acceptance profile
            return real(rt, ids, max_new_tokens, specs)
        long = min(len(p) for p in ids) >= 20
        rates = [
            10.0 if s is None else (14.0 - s.num_draft_tokens if long else 12.0 + s.num_draft_tokens) for s in specs
        ]
        return [Measured(100, 100 / r, 0.0, 4, 4, 0) for r in rates]

    monkeypatch.setattr(tree_tuner, "measure_generation", rigged)
    monkeypatch.setattr(tree_tuner, "candidates_at", lambda *a, **k: [ts.SpecConfig.chain(1), ts.SpecConfig.chain(3)])
    model, drafter = perm_pair("llama", vocab=24, seed=0, alpha=0.3)
    short, long = random_prompts(24, [4, 5, 6], seed=1), random_prompts(24, [30, 40, 50], seed=2)
    kw = dict(max_new_tokens=8, max_depth=3, top_ks=(1,), max_draft_tokens=4, reps=1, validate=False)
    res = tune_tree(model, drafter, short, out_dir=tuned_dir, sampled=True, long_prompts=long, **kw)
    rows = {(r["batch_size"], r["sampling"], r.get("context", 0)): r for r in res.shapes}
    t = round((5 * 40) ** 0.5)
    assert set(rows) == {(1, "greedy", 0), (1, "sampled", 0), (1, "greedy", t), (1, "sampled", t)}
    assert rows[1, "greedy", 0]["spec"] == ts.SpecConfig.chain(3) and rows[1, "greedy", t][
        "spec"
    ] == ts.SpecConfig.chain(1)
    assert rows[1, "sampled", t]["prompt_tokens"] == 40
    from tritonspec.runtime import profiles as prof

    data = prof.read_profile(res.profile_path)
    assert [r.get("context", 0) for r in data["shapes"]] == [0, 0, t, t]
    rt = runtime(model, drafter, spec=None, max_seq_len=96)
    assert rt.shape_policy.choose(1, True).spec == ts.SpecConfig.chain(3)
    out = rt.generate(random_prompts(24, [t + 1], seed=3), max_new_tokens=6)
    assert out.stats.spec == ts.SpecConfig.chain(1) and out.stats.spec_source == f"profile, context >= {t}"
    assert rt.generate(short[:1], max_new_tokens=6).stats.spec == ts.SpecConfig.chain(3)
    # the inverse: "long" prompts no longer than the others are refused, not written as a bucket
    with pytest.raises(ValueError, match="at least twice"):
        tune_tree(model, drafter, short, long_prompts=random_prompts(24, [6, 7], seed=4), dry_run=True, **kw)


def test_long_prompts_are_tuned_at_every_batch_size_the_short_rows_were(tuned_dir, monkeypatch):
    """With ``batch_sizes``, step 8 measures the long prompts at each batch size too, around the
    long batch-1 winner's row budget, and a batch of long prompts runs its own measured row (before:
    the rule scaled from the long batch-1 row, here plain decoding at batch 2)."""
    from tritonspec.autotune.tree_measure import Measured

    real = tree_tuner.measure_generation
    seeds = []

    def rigged(rt, ids, max_new_tokens, specs, batch_size=1, temperature=0.0, repeats=1):
        if specs == [None]:
            return real(rt, ids, max_new_tokens, specs)
        long = min(len(p) for p in ids) >= 20
        if not long:  # a deep chain wins short prompts at every batch
            rates = [10.0 if s is None else 12.0 + s.num_draft_tokens for s in specs]
        elif batch_size == 1:  # a one-token chain wins long ones alone
            rates = [10.0 if s is None else 14.0 - s.num_draft_tokens for s in specs]
        else:  # and the deep chain again in a batch of long prompts
            rates = [10.0 if s is None else 10.0 + s.num_draft_tokens for s in specs]
        return [Measured(100, 100 / r, 0.0, 4, 4, 0) for r in rates]

    def cands(b, greedy, chosen, *a, **k):
        seeds.append((b, chosen))
        return [ts.SpecConfig.chain(1), ts.SpecConfig.chain(3)]

    real_search = tree_tuner.search

    def search(*a, **k):  # the cost model's pick fixed, unlike the long batch-1 winner
        ranked = real_search(*a, **k)
        return [dataclasses.replace(ranked[0], spec=ts.SpecConfig.chain(3)), *ranked[1:]]

    monkeypatch.setattr(tree_tuner, "measure_generation", rigged)
    monkeypatch.setattr(tree_tuner, "candidates_at", cands)
    monkeypatch.setattr(tree_tuner, "search", search)
    model, drafter = perm_pair("llama", vocab=24, seed=0, alpha=0.3)
    short, long = random_prompts(24, [4, 5, 6], seed=1), random_prompts(24, [30, 40, 50], seed=2)
    kw = dict(max_new_tokens=8, max_depth=3, top_ks=(1,), max_draft_tokens=4, reps=1, validate=False)
    res = tune_tree(model, drafter, short, out_dir=tuned_dir, batch_sizes=(1, 2), long_prompts=long, **kw)
    rows = {(r["batch_size"], r["sampling"], r.get("context", 0)): r["spec"] for r in res.shapes}
    t = round((5 * 40) ** 0.5)
    chain = ts.SpecConfig.chain
    assert rows == {
        (1, "greedy", 0): chain(3),
        (2, "greedy", 0): chain(3),
        (1, "greedy", t): chain(1),
        (2, "greedy", t): chain(3),
    }
    assert seeds == [(1, chain(3)), (2, chain(3)), (1, chain(3)), (2, chain(1))]  # long b2: the long b1 winner's
    rt = runtime(model, drafter, spec=None, max_seq_len=96, max_batch_size=2)
    assert rt.shape_policy.choose(2, True, t).spec == chain(3)
    assert rt.shape_policy.choose(1, True, t).spec == chain(1)
    out = rt.generate(random_prompts(24, [t + 1, 6], seed=3), max_new_tokens=6)
    assert out.stats.spec == chain(3) and out.stats.spec_source == f"profile, context >= {t}"
    # the inverse: without the batch-2 long row the bucket's rule runs (chain(1)'s 2 rows over 2 prompts: plain)
    data = json.loads(res.profile_path.read_text())
    data["shapes"] = [r for r in data["shapes"] if (r["batch_size"], r.get("context", 0)) != (2, t)]
    res.profile_path.write_text(json.dumps(data))
    rt = runtime(model, drafter, spec=None, max_seq_len=96, max_batch_size=2)
    assert rt.shape_policy.choose(2, True, t).spec is None


def test_cli_reads_chat_prompt_rows(tmp_path, monkeypatch):
    """``--prompts``/``--long-prompts`` JSONL rows of ``{"messages": [...]}`` are rendered by the
    target's chat template (token ids); plain rows stay strings; a chat file for a target without a
    tokenizer is a clear error."""
    from tritonspec.cli.autotune import read_tune_prompts
    from tritonspec.runtime import weights
    from tritonspec.runtime.requests import chat_ids
    from tritonspec.runtime.weights import load_tokenizer

    t, _ = ts.demo_pair("eagle3.1")
    tok = load_tokenizer(t)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    monkeypatch.setattr(weights, "load_tokenizer", lambda path: tok if str(path) == str(t) else None)
    msgs = [{"role": "user", "content": "hello"}]
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": msgs}) + "\n" + json.dumps({"prompt": "def f(x):"}) + "\n")
    assert read_tune_prompts(str(f), t) == [chat_ids(tok, msgs), "def f(x):"]
    with pytest.raises(ValueError, match="chat template"):
        read_tune_prompts(str(f), tmp_path)


@pytest.mark.parametrize("lookup_wins", [True, False])
def test_a_row_plain_decoding_won_tries_the_lookup_on_the_cheapest_chain(tuned_dir, monkeypatch, lookup_wins):
    """Step 7 on a greedy row whose winner is plain decoding: the one-token chain with each lookup
    length is measured against plain decoding and kept only if faster (the inverse: it loses and
    the row stays plain). Sampled rows that plain decoding won are left alone."""
    from tritonspec.autotune.tree_measure import Measured

    real = tree_tuner.measure_generation

    def rigged(rt, ids, max_new_tokens, specs, batch_size=1, temperature=0.0, repeats=1):
        if specs == [None]:
            return real(rt, ids, max_new_tokens, specs)
        lookup = 30.0 if lookup_wins else 5.0
        rates = [20.0 if s is None else lookup if s.prompt_lookup_num_tokens else 10.0 for s in specs]
        return [Measured(100, 100 / r, 0.0, 4, 4, 0) for r in rates]

    monkeypatch.setattr(tree_tuner, "measure_generation", rigged)
    monkeypatch.setattr(tree_tuner, "candidates_at", lambda *a, **k: [ts.SpecConfig.chain(2)])
    model, drafter = perm_pair("llama", vocab=24, seed=0, alpha=0.3)
    res = tune_tree(
        model, drafter, random_prompts(24, [5, 7], seed=1), max_new_tokens=8, max_depth=2, top_ks=(1,),
        max_draft_tokens=3, reps=1, out_dir=tuned_dir, validate=False, sampled=True, prompt_lookup=(4,),
    )  # fmt: skip
    rows = {(r["batch_size"], r["sampling"]): r for r in res.shapes}
    greedy, sampled = rows[1, "greedy"], rows[1, "sampled"]
    assert set(greedy["lookup_decode_tokens_per_s"]) == {"plain", "(1,1,2)+lookup4"}
    want = ts.SpecConfig(1, 1, 2, prompt_lookup_num_tokens=4) if lookup_wins else None
    assert greedy["spec"] == want
    assert sampled["spec"] is None and "lookup_decode_tokens_per_s" not in sampled


@pytest.mark.parametrize("batch, gap, kept", [(1, 0.02, True), (1, 0.05, True), (1, 0.08, False), (2, 0.02, False)])
def test_a_lookup_branch_within_the_tie_margin_is_kept_at_batch_one(tuned_dir, monkeypatch, batch, gap, kept):
    """``LOOKUP_TIE``: at batch 1 the lookup variant stays when it measures within 6% of the fastest
    shape (its cost is bounded where outputs do not quote the prompt, its gain large where they do);
    the inverse: 8% slower, or a tie at batch 2 (where every row's branch adds verified rows), drops it."""
    from tritonspec.autotune.tree_measure import Measured

    def rigged(rt, ids, max_new_tokens, specs, batch_size=1, temperature=0.0, repeats=1):
        rates = [10.0 if s is None else 20.0 * (1 - gap) if s.prompt_lookup_num_tokens else 20.0 for s in specs]
        return [Measured(100, 100 / r, 0.0, 4, 4, 0) for r in rates]

    monkeypatch.setattr(tree_tuner, "measure_generation", rigged)
    row = {"batch_size": batch, "sampling": "greedy", "spec": ts.SpecConfig.chain(2), "temperature": 0.0}
    tree_tuner._lookup_at(None, [[1, 2]], 8, row, (4,), lambda *_: None)
    assert row["spec"] == (ts.SpecConfig(2, 1, 3, prompt_lookup_num_tokens=4) if kept else ts.SpecConfig.chain(2))


@pytest.mark.parametrize("gain, wins", [(1.02, False), (1.06, False), (1.10, True)])
def test_a_shape_must_beat_plain_decoding_by_the_margin_to_take_a_row(monkeypatch, gain, wins):
    """``PLAIN_MARGIN``: a row goes to a speculative shape only when it measures more than 8% faster
    than plain decoding (a tie on the tuning prompts risks a loss elsewhere); 10% faster wins it."""
    from tritonspec.autotune.tree_measure import Measured

    def rigged(rt, ids, max_new_tokens, specs, batch_size=1, temperature=0.0, repeats=1):
        return [Measured(100, 100 / (10.0 if s is None else 10.0 * gain), 0.0, 4, 4, 0) for s in specs]

    class Rt:
        device = torch.device("cpu")

    monkeypatch.setattr(tree_tuner, "measure_generation", rigged)
    monkeypatch.setattr(tree_tuner, "candidates_at", lambda *a, **k: [ts.SpecConfig.chain(2)])
    big = ts.SpecConfig(3, 1, 4)
    row = tree_tuner._best_at(Rt(), [[1, 2]], 8, 4, "greedy", 0.0, big, big, lambda *_: None)
    assert row["spec"] == (ts.SpecConfig.chain(2) if wins else None)


def test_a_winner_with_a_lookup_branch_is_measured_bare_and_with_each_length(monkeypatch):
    """A row whose winner already has a branch (the short prompts' shape winning a long-context row)
    is measured without it and with each length, once each."""
    from tritonspec.autotune.tree_measure import Measured

    seen = []

    def rigged(rt, ids, max_new_tokens, specs, batch_size=1, temperature=0.0, repeats=1):
        seen.extend(specs)
        return [
            Measured(100, 100 / (10.0 if s is None else 20.0 + s.prompt_lookup_num_tokens), 0.0, 4, 4, 0) for s in specs
        ]

    monkeypatch.setattr(tree_tuner, "measure_generation", rigged)
    spec = ts.SpecConfig(3, 1, 4, prompt_lookup_num_tokens=4)
    row = {"batch_size": 1, "sampling": "greedy", "spec": spec, "temperature": 0.0}
    tree_tuner._lookup_at(None, [[1, 2]], 8, row, (4, 8), lambda *_: None)
    assert set(row["lookup_decode_tokens_per_s"]) == {"plain", "(3,1,4)", "(3,1,4)+lookup4", "(3,1,4)+lookup8"}
    assert len(seen) == 4 and row["spec"] == ts.SpecConfig(3, 1, 4, prompt_lookup_num_tokens=8)


@pytest.mark.parametrize(
    "plain, bare, l4, l8, want",
    [
        (10.0, 19.0, 19.7, 20.0, 4),  # lengths tied (within LOOKUP_TIE of the fastest): the shorter branch
        (10.0, 19.0, 18.0, 20.0, 8),  # the inverse: lookup 4 10% slower, lookup 8 kept
        (10.0, 19.0, 20.0, 19.0, 4),  # the shorter one fastest anyway
        (10.0, 19.0, 18.5, 18.9, 4),  # the bare shape fastest, both lengths tied with it: the shorter
        (19.6, 20.0, 19.5, 19.9, 8),  # the shorter tied one slower than plain decoding: the longer tied one
    ],
)
def test_of_tied_lookup_lengths_the_shortest_is_kept(monkeypatch, plain, bare, l4, l8, want):
    """Among branches within ``LOOKUP_TIE`` of the fastest shape that beat plain decoding, the shortest
    is kept (fewer verified rows where the branch does not pay); one measurably faster keeps its length."""
    from tritonspec.autotune.tree_measure import Measured

    def rigged(rt, ids, max_new_tokens, specs, batch_size=1, temperature=0.0, repeats=1):
        rates = [plain if s is None else {0: bare, 4: l4, 8: l8}[s.prompt_lookup_num_tokens] for s in specs]
        return [Measured(100, 100 / r, 0.0, 4, 4, 0) for r in rates]

    monkeypatch.setattr(tree_tuner, "measure_generation", rigged)
    row = {"batch_size": 1, "sampling": "greedy", "spec": ts.SpecConfig(2, 1, 3), "temperature": 0.0}
    tree_tuner._lookup_at(None, [[1, 2]], 8, row, (4, 8), lambda *_: None)
    assert row["spec"] == ts.SpecConfig(2, 1, 3, prompt_lookup_num_tokens=want)


@pytest.mark.parametrize(
    "batch, plain_rate, lookup_rate, want",
    [
        (4, 19.0, 16.0, "bare"),  # still faster than plain decoding (by less than PLAIN_MARGIN): kept
        (4, 21.0, 16.0, None),  # slower than plain decoding here, with or without a branch: plain
        (1, 19.0, 19.5, "lookup"),  # a branch within LOOKUP_TIE that beats plain decoding: kept
        (1, 19.7, 19.5, "bare"),  # within LOOKUP_TIE but slower than plain decoding: the bare shape
    ],
)
def test_the_lookup_pass_gives_a_row_to_plain_decoding_when_plain_measures_faster(
    monkeypatch, batch, plain_rate, lookup_rate, want
):
    """The lookup pass measures plain decoding again beside the row's shape (two runs): a shape that
    won the row pass but runs slower than plain decoding here loses the row; a shape still faster
    keeps it; a lookup branch kept for a tie at batch 1 must beat plain decoding too."""
    from tritonspec.autotune.tree_measure import Measured

    def rigged(rt, ids, max_new_tokens, specs, batch_size=1, temperature=0.0, repeats=1):
        rates = [plain_rate if s is None else lookup_rate if s.prompt_lookup_num_tokens else 20.0 for s in specs]
        return [Measured(100, 100 / r, 0.0, 4, 4, 0) for r in rates]

    monkeypatch.setattr(tree_tuner, "measure_generation", rigged)
    row = {"batch_size": batch, "sampling": "greedy", "spec": ts.SpecConfig(1, 1, 2), "temperature": 0.0}
    tree_tuner._lookup_at(None, [[1, 2]], 8, row, (4,), lambda *_: None)
    expect = {"bare": ts.SpecConfig(1, 1, 2), "lookup": ts.SpecConfig(1, 1, 2, prompt_lookup_num_tokens=4), None: None}
    assert row["spec"] == expect[want]
    assert row["lookup_decode_tokens_per_s"]["plain"] == plain_rate


@pytest.mark.parametrize("min1_rate, want", [(21.0, 1), (20.0, 2), (19.5, 2)])
def test_each_lookup_length_is_measured_with_each_suffix_minimum(monkeypatch, min1_rate, want):
    """``prompt_lookup_min=(1, 2)``: every branch length is measured with both minimums (labels
    ``+lookupM`` and ``+lookupMmin1``); of one length's minimums within ``LOOKUP_TIE``, the faster
    is kept. The inverse: a tie or a slower min 1 keeps the default 2."""
    from tritonspec.autotune.tree_measure import Measured

    def rate(s):
        if s is None or not s.prompt_lookup_num_tokens:
            return 10.0 if s is None else 18.0  # plain decoding, the bare shape
        return min1_rate if s.prompt_lookup_min == 1 else 20.0

    def rigged(rt, ids, max_new_tokens, specs, batch_size=1, temperature=0.0, repeats=1):
        return [Measured(100, 100 / rate(s), 0.0, 4, 4, 0) for s in specs]

    monkeypatch.setattr(tree_tuner, "measure_generation", rigged)
    row = {"batch_size": 1, "sampling": "greedy", "spec": ts.SpecConfig(2, 1, 3), "temperature": 0.0}
    tree_tuner._lookup_at(None, [[1, 2]], 8, row, (4,), lambda *_: None, (1, 2))
    assert set(row["lookup_decode_tokens_per_s"]) == {"plain", "(2,1,3)", "(2,1,3)+lookup4min1", "(2,1,3)+lookup4"}
    assert row["spec"] == ts.SpecConfig(2, 1, 3, prompt_lookup_num_tokens=4, prompt_lookup_min=want)


def test_tune_tree_refuses_a_lookup_min_out_of_range():
    model, drafter = perm_pair("llama", vocab=24, seed=0, alpha=0.3)
    for bad in ((0,), (4,)):
        with pytest.raises(ValueError, match="prompt_lookup_min=.*1..3"):
            tune_tree(model, drafter, [[1, 2]], prompt_lookup=(4,), prompt_lookup_min=bad, dry_run=True)
