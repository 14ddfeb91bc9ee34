"""runtime/bench.py: systems measured side by side, interleaved chunk by chunk."""

from __future__ import annotations

import statistics

import pytest
import torch

from tritonspec.runtime.bench import Bench, _Runner
from tritonspec.runtime.errors import UserError
from tritonspec.runtime.tiny import tiny_random_pair

SYSTEMS = ["ours-plain", "hf-greedy", "ours-eagle3.1"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    torch.set_num_threads(1)
    t, d = tiny_random_pair(tmp_path_factory.mktemp("pair"))
    return Bench(t, {"eagle3.1": d}, None, max_seq_len=256)


PROMPTS = ["def f(x):", "import os\n", "class A:\n    pass\n", "x = 1\ny = 2\n", "for i in range(3):"]


@pytest.mark.parametrize("batch", [1, 2])
def test_interleaved_runs_equal_runs_one_at_a_time(bench, batch):
    """The interleaved group gives each system the tokens (and τ) it gives alone; greedy speculative
    output equals plain output."""
    res = bench.run_interleaved(SYSTEMS, PROMPTS, "s", 0.0, batch, 7)
    assert list(res) == SYSTEMS
    for s in SYSTEMS:
        alone = bench.run(s, PROMPTS, "s", 0.0, batch, 7)
        r = res[s]
        assert (r.system, r.prompts, r.new_tokens, r.batch) == (s, len(PROMPTS), len(PROMPTS) * 7, batch)
        assert r.token_ids == alone.token_ids, s
        assert r.wall_time_s > 0 and r.tokens_per_second > 0
        assert r.tau == alone.tau
    assert res["ours-eagle3.1"].token_ids == res["ours-plain"].token_ids
    assert res["ours-plain"].tau is None and res["ours-eagle3.1"].tau >= 1
    assert len(res["ours-eagle3.1"].accepted_per_position) > 0


def test_interleaved_order_rotates_per_chunk(bench, monkeypatch):
    """Chunk i runs every system once, starting at system i mod n; each system's wall time sums only
    its own chunks (an inverse: a system made slow inside its timed call is the only one whose time
    grows)."""
    import time

    from tritonspec.runtime.bench import _HFRunner

    order = []
    timed, generate = _Runner.timed, _HFRunner.generate

    def record(self, i, chunk, p=0):
        order.append((i, self.system))
        timed(self, i, chunk, p)

    def slow(self, i, chunk, max_new_tokens, keep=True):  # a slow system: 0.25 s more per timed chunk
        if keep:
            time.sleep(0.25)
        return generate(self, i, chunk, max_new_tokens, keep)

    monkeypatch.setattr(_Runner, "timed", record)
    monkeypatch.setattr(_HFRunner, "generate", slow)
    res = bench.run_interleaved(SYSTEMS, PROMPTS[:4], "s", 0.0, 1, 3)
    assert order == [
        (0, "ours-plain"), (0, "hf-greedy"), (0, "ours-eagle3.1"),
        (1, "hf-greedy"), (1, "ours-eagle3.1"), (1, "ours-plain"),
        (2, "ours-eagle3.1"), (2, "ours-plain"), (2, "hf-greedy"),
        (3, "ours-plain"), (3, "hf-greedy"), (3, "ours-eagle3.1"),
    ]  # fmt: skip
    assert res["hf-greedy"].wall_time_s >= 1.0
    assert res["ours-plain"].wall_time_s < res["hf-greedy"].wall_time_s - 0.9
    assert res["ours-eagle3.1"].wall_time_s < res["hf-greedy"].wall_time_s - 0.9


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_passes_time_each_pass_and_keep_the_first_passes_tokens(bench, monkeypatch, temperature):
    """``passes=3``: each system's wall time per pass (``wall_time_s`` their median), the first pass's tokens and
    counts (those of a one-pass run), the same tokens every pass (greedy and seeded sampling), and
    ``perf/report.py`` reads the speedup pass by pass. Inverses: a pass made slow for one system moves that
    pass's time and ratio, not the median; a system whose later pass generates other tokens says so."""
    import time

    from tritonspec.runtime.bench import _OursRunner

    from _util import perf_module

    report = perf_module("report", "perf_report")
    systems = ["ours-plain", "ours-eagle3.1"]
    res = bench.run_interleaved(systems, PROMPTS[:3], "s", temperature, 1, 5, seed=2, passes=3)
    one = bench.run_interleaved(systems, PROMPTS[:3], "s", temperature, 1, 5, seed=2)
    for s in systems:
        r = res[s]
        assert len(r.pass_wall_s) == 3 and r.wall_time_s == sorted(r.pass_wall_s)[1]
        assert r.new_tokens == 15 and r.token_ids == one[s].token_ids and r.tau == one[s].tau
        assert r.same_tokens_every_pass is True and one[s].same_tokens_every_pass is None
        assert one[s].pass_wall_s == [one[s].wall_time_s]
    plain, spec = res["ours-plain"].info(), res["ours-eagle3.1"].info()
    ratios = report.pass_speedups(spec, plain)
    assert ratios == [p / x for p, x in zip(plain["pass_wall_s"], spec["pass_wall_s"])]
    assert report.pass_speedups(one["ours-eagle3.1"].info(), one["ours-plain"].info()) == []  # one pass: none
    text, _ = report.render([plain, spec], "x.json")
    assert "3 interleaved passes" in text and "every pass generated the same tokens" in text
    assert f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" in text

    generate = _OursRunner.generate
    timed_calls = []  # ours-plain's timed calls (max_new_tokens 5; the untimed warm call asks for 2)

    def slow_then_other(self, i, chunk, max_new_tokens, keep=True):
        ids = generate(self, i, chunk, max_new_tokens, keep)
        if self.system != "ours-plain" or max_new_tokens != 5:
            return ids
        timed_calls.append(i)
        if not 3 < len(timed_calls) <= 6:  # passes 0 and 2 as they are
            return ids
        time.sleep(0.3)  # pass 1 (plain's timed calls 4-6): slow, and other tokens
        return [[t + 1 for t in ids[0]]]

    monkeypatch.setattr(_OursRunner, "generate", slow_then_other)
    bad = bench.run_interleaved(systems, PROMPTS[:3], "s", temperature, 1, 5, seed=2, passes=3)
    w = bad["ours-plain"].pass_wall_s
    assert w[1] > max(w[0], w[2]) + 0.8 and bad["ours-plain"].wall_time_s < w[1] - 0.8  # the median ignores it
    assert bad["ours-plain"].same_tokens_every_pass is False and bad["ours-eagle3.1"].same_tokens_every_pass
    assert bad["ours-plain"].token_ids == one["ours-plain"].token_ids  # the first pass's tokens
    text, _ = report.render([bad["ours-plain"].info(), bad["ours-eagle3.1"].info()], "x.json")
    assert "some pass generated other tokens" in text
    with pytest.raises(UserError, match="passes=0"):
        bench.run_interleaved(systems, PROMPTS[:1], "s", passes=0)


def test_interleaved_sampling_seeds_per_chunk(bench):
    """Chunk i samples with seed + i, as a system run alone does: same seeds, same tokens."""
    a = bench.run_interleaved(["ours-plain", "ours-eagle3.1"], PROMPTS[:3], "s", 1.0, 1, 6, seed=5)
    b = bench.run("ours-eagle3.1", PROMPTS[:3], "s", 1.0, 1, 6, seed=5)
    assert a["ours-eagle3.1"].token_ids == b.token_ids
    c = bench.run("ours-eagle3.1", PROMPTS[:3], "s", 1.0, 1, 6, seed=6)
    assert c.token_ids != b.token_ids  # the seed is used


def test_interleaved_bad_input_names_the_problem(bench):
    with pytest.raises(UserError, match="unknown system 'nope'"):
        bench.run_interleaved(["ours-plain", "nope"], PROMPTS, "s")
    with pytest.raises(UserError, match="no systems"):
        bench.run_interleaved([], PROMPTS, "s")
    with pytest.raises(UserError, match="no prompts"):
        bench.run_interleaved(SYSTEMS, [], "s")
    with pytest.raises(ValueError, match="hf-prompt-lookup at batch 2"):
        bench.run_interleaved(["ours-plain", "hf-prompt-lookup"], PROMPTS, "s", batch=2)


def test_a_fixed_shape_variant_runs_beside_the_adaptive_system(bench):
    """``add_fixed_shape`` adds ``<system>-fixed`` (adaptive_shape=False, the same drafter loaded again):
    a system run_interleaved accepts, with the same tokens; a forced ladder makes only the adaptive
    one switch, and the results count its switches and rounds per shape."""
    from tritonspec.runtime.adaptive import LAMBDAS, ShapeLadder
    from tritonspec.runtime.config import SpecConfig
    from tritonspec.runtime.spec_policy import ShapePolicy

    name = bench.add_fixed_shape("ours-eagle3.1")
    assert name == "ours-eagle3.1-fixed" and bench.runtimes[name].adaptive_shape is False
    assert bench.runtimes["ours-eagle3.1"].adaptive_shape is True
    big, small, n = SpecConfig(3, 2, 7), SpecConfig.chain(1), len(LAMBDAS)
    saved = bench.runtimes["ours-eagle3.1"]._policy
    for s in ("ours-eagle3.1", name):  # a profile-like policy whose ladder always prefers `small`
        policy = ShapePolicy("profile", 7, table={(1, "greedy"): big})
        policy.ladders[1, "greedy"] = ShapeLadder((big, small), ((2.0,) * n, (2.0,) * n), (1.0, 0.5), (1,) * n)
        bench.runtimes[s]._policy = policy
    try:
        res = bench.run_interleaved(["ours-plain", name, "ours-eagle3.1"], PROMPTS, "s", 0.0, 1, 12)
    finally:  # the module's bench serves other tests
        bench.runtimes["ours-eagle3.1"]._policy = saved
        del bench.runtimes[name]
    assert res[name].token_ids == res["ours-eagle3.1"].token_ids == res["ours-plain"].token_ids
    assert res[name].shape_switches == 0 and list(res[name].rounds_per_shape) == [big.label]
    assert res["ours-eagle3.1"].shape_switches == len(PROMPTS)
    assert set(res["ours-eagle3.1"].rounds_per_shape) == {big.label, small.label}
    assert res["ours-eagle3.1"].info()["rounds_per_shape"] == res["ours-eagle3.1"].rounds_per_shape
    with pytest.raises(UserError, match="add_fixed_shape takes one of our speculative systems"):
        bench.add_fixed_shape("hf-greedy")
