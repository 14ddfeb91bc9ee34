"""Out-of-the-box shapes (runtime/spec_policy.py, runtime/profiles.py): the rule by batch size and
sampling mode, shipped profiles for the bundled pair, user profiles overriding them, broken ones
skipped with a warning, and the choice reported in the stats and on the CLI's stats line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import tritonspec as ts
from tritonspec.kernels import store
from tritonspec.runtime import profiles as prof
from tritonspec.runtime.spec_policy import (
    PROMPT_PASS_BYTES_PER_FLOP,
    ROW_BUDGET,
    ShapePolicy,
    prompt_pass_pays,
    prompt_pass_ratio,
    rule_shape,
)

from _util import perm_pair, random_prompts, runtime

C = ts.SpecConfig.chain


@pytest.mark.parametrize(
    "batch, greedy, budget, device, want",
    [
        (1, True, 8, "cpu", ts.SpecConfig(3, 2, 7)),
        (2, True, 8, "cpu", C(3)),
        (3, True, 8, "cpu", C(1)),
        (4, True, 8, "cpu", C(1)),
        (5, True, 8, "cpu", None),
        (8, True, 8, "cpu", None),
        (1, False, 8, "cpu", C(4)),
        (2, False, 8, "cpu", C(3)),
        (4, False, 8, "cpu", C(1)),
        (8, False, 8, "cpu", None),
        (1, True, 64, "cuda", ts.SpecConfig(6, 8, 48)),
        (4, True, 64, "cuda", ts.SpecConfig(6, 4, 16)),
        (8, True, 64, "cuda", ts.SpecConfig(6, 2, 8)),
        (32, True, 64, "cuda", C(1)),
        (64, True, 64, "cuda", None),
    ],
)
def test_rule_shrinks_the_verified_rows_as_the_batch_grows(batch, greedy, budget, device, want):
    got = rule_shape(batch, greedy, budget, device)
    assert got == want
    if got is not None:  # the rows a round verifies, summed over the batch, stay within the budget
        assert batch * got.num_draft_tokens <= budget


def test_policy_table_rows_then_the_rule():
    p = ShapePolicy("profile", 7, table={(1, "greedy"): C(5), (4, "greedy"): C(2), (2, "sampled"): None}, path="f")
    assert p.choose(1, True).spec == C(5) and p.choose(4, True).spec == C(2) and p.choose(4, True).source == "profile"
    # a batch between rows: the larger row's shape (it paid on more rows); above the rows, the rule within
    # the rows the next smaller row verified
    assert p.choose(3, True).spec == C(2) and p.choose(3, True).source == "profile, batch 4's row"
    assert p.choose(2, True).spec == C(2) and p.choose(2, True).path == "f"
    q = ShapePolicy("profile", 7, table={(1, "greedy"): C(5), (4, "greedy"): None})  # plain won at 4: the rule
    assert q.choose(3, True).spec == rule_shape(3, True, 1 * 6) == C(1) and q.choose(3, True).source == "profile rule"
    assert p.choose(6, True).spec == rule_shape(6, True, 4 * 3) == C(1)
    assert p.choose(12, True).spec is None  # 4 x 3 rows over 12 requests: plain decoding
    assert p.choose(2, False).spec is None and p.choose(8, False).spec is None  # plain decoding won at 2
    r = p.choose(1, False)  # no sampled row at or below batch 1: the rule at this profile's budget
    assert r.spec == rule_shape(1, False, 7) and r.source == "profile rule" and r.path == "f"
    assert ShapePolicy.caller(C(2)).choose(8, False).spec == C(2)
    assert ShapePolicy.heuristic(torch.device("cpu")).budget == ROW_BUDGET["cpu"]
    big = p.largest(8)
    assert big.num_speculative_tokens >= 5 and big.num_draft_tokens >= 6


def test_a_batch_one_table_says_nothing_about_larger_batches():
    """A profile tuned at batch 1 only (greedy and sampled rows) scales by the rule above batch 1
    instead of running its batch-1 shape on every row of a larger batch (which verifies B times the
    rows the shape was tuned for: SmolLM2's (3,2,5)+lookup4 ran 0.49-0.77x of plain at batch 4)."""
    b1 = ts.SpecConfig(3, 2, 5, prompt_lookup_num_tokens=4)
    p = ShapePolicy("profile", 5, table={(1, "greedy"): b1, (1, "sampled"): C(3)}, path="f")
    assert p.choose(1, True).spec == b1 and p.choose(1, False).spec == C(3)
    for batch in (2, 3, 4, 8):
        for greedy in (True, False):
            got = p.choose(batch, greedy)
            assert got.spec == rule_shape(batch, greedy, 5) and got.source == "profile rule", (batch, greedy)
    assert p.choose(2, True).spec == C(1) and p.choose(4, True).spec is None  # 5 // 4 rows: plain decoding
    # the same from a profile file's fields (policy_from_profile builds that table)
    data = {"spec": {"num_speculative_tokens": 3, "top_k": 2, "num_draft_tokens": 5, "prompt_lookup_num_tokens": 4}}
    sampled = {"num_speculative_tokens": 3, "top_k": 1, "num_draft_tokens": 4}
    data["shapes"] = [{"batch_size": 1, "sampling": "sampled", "spec": sampled}]
    filed = prof.policy_from_profile(data, "shipped profile", "cpu", "f")
    assert filed.choose(1, True).spec == b1 and filed.choose(1, False).spec == C(3)
    assert filed.choose(4, True).spec is None and filed.choose(4, True).source == "shipped profile rule"
    assert filed.choose(2, False).spec == C(1)
    # batch 3 of a table measured at 1, 2 and 4 runs batch 4's shape (paid on 4 rows), never batch 2's on 3 rows
    q = ShapePolicy("profile", 5, table={(1, "greedy"): b1, (2, "greedy"): C(2), (4, "greedy"): C(1)}, path="f")
    assert q.choose(2, True).spec == C(2) and q.choose(4, True).spec == C(1) and q.choose(4, True).source == "profile"
    assert q.choose(3, True).spec == C(1) and q.choose(3, True).source == "profile, batch 4's row"
    assert q.choose(8, True).spec is None  # 4 x 2 rows over 8 requests
    # the inverse: rows measured at every batch are taken as measured
    full = ShapePolicy("profile", 5, table={(b, "greedy"): C(3) for b in (1, 2, 3, 4)}, path="f")
    assert all(full.choose(b, True).spec == C(3) and full.choose(b, True).source == "profile" for b in (1, 2, 3, 4))


def test_long_prompts_take_the_rows_measured_on_long_prompts():
    """Rows with a ``context`` threshold (``autotune tree --long-prompts``) serve prompts of at least
    that many tokens; shorter prompts keep the base rows; each bucket scales its own batch-1 row
    for batches it did not measure; ``largest`` covers every bucket (it sizes the caches)."""
    b1 = ts.SpecConfig(3, 2, 5, prompt_lookup_num_tokens=4)
    data = {
        "spec": {"num_speculative_tokens": 3, "top_k": 2, "num_draft_tokens": 5, "prompt_lookup_num_tokens": 4},
        "shapes": [
            {
                "batch_size": 1,
                "sampling": "sampled",
                "spec": {"num_speculative_tokens": 3, "top_k": 1, "num_draft_tokens": 4},
            },
            {
                "batch_size": 1,
                "sampling": "greedy",
                "context": 700,
                "spec": {"num_speculative_tokens": 1, "top_k": 1, "num_draft_tokens": 2},
            },
            {"batch_size": 1, "sampling": "sampled", "context": 700, "spec": None},
            {"batch_size": 1, "sampling": "greedy", "context": 5000, "spec": None},
        ],
    }
    p = prof.policy_from_profile(data, "shipped profile", "cpu", "f")
    assert sorted(p.contexts) == [700, 5000]
    for context in (0, 1, 699):
        assert p.choose(1, True, context).spec == b1 and p.choose(1, True, context).source == "shipped profile"
        assert p.choose(1, False, context).spec == C(3)
    long = p.choose(1, True, 700)
    assert long.spec == C(1) and long.source == "shipped profile, context >= 700" and long.path == "f"
    assert p.choose(1, True, 4999).spec == C(1) and p.choose(1, False, 2000).spec is None  # plain won there
    assert (
        p.choose(1, True, 5000).spec is None and p.choose(1, True, 10**6).source == "shipped profile, context >= 5000"
    )
    # batch 2 at a long context: the rule scaled by that bucket's batch-1 row (2 rows: 2 // 2 = 1, plain)
    two = p.choose(2, True, 800)
    assert two.spec is None and two.source == "shipped profile rule, context >= 700"
    assert p.choose(2, True, 100).spec == rule_shape(2, True, 5)  # short prompts: the base budget
    # a bucket whose batch-1 greedy row is plain decoding decodes plainly at every batch and mode
    assert p.choose(4, False, 6000).spec is None and p.choose(1, False, 6000).spec is None
    big = p.largest(4)
    assert big.num_speculative_tokens >= 3 and big.top_k >= 2 and big.prompt_lookup_num_tokens >= 4
    # the inverse: without context rows every prompt length gets the base rows
    base = prof.policy_from_profile({**data, "shapes": data["shapes"][:1]}, "shipped profile", "cpu")
    assert not base.contexts and base.choose(1, True, 10**6).spec == b1
    # a caller's shape is never replaced by a context row
    assert ShapePolicy.caller(C(2)).choose(1, True, 10**6).spec == C(2)


@pytest.mark.parametrize("context", [-1, 1.5, "700"])
def test_a_bad_context_threshold_is_refused(tmp_path, context):
    row = {"batch_size": 1, "sampling": "greedy", "context": context, "spec": None}
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps(
            {
                "kind": prof.KIND,
                "spec": {"num_speculative_tokens": 1, "top_k": 1, "num_draft_tokens": 2},
                "shapes": [row],
            }
        )
    )
    with pytest.raises(ValueError, match="context must be an integer"):
        prof.read_profile(path)


def test_the_runtime_picks_the_long_context_row_by_the_longest_prompt(fresh_cache, tmp_path, monkeypatch):
    """End to end through a user profile: a request whose longest prompt reaches the threshold runs
    the long-context row (stats and source say so); shorter requests run the base row; greedy
    output equals plain decoding either way."""
    t, d, shipped, tm = _shipped_here(monkeypatch, tmp_path, "eagle3.1")
    data = prof.read_profile(shipped)
    spec = {"num_speculative_tokens": 4, "top_k": 1, "num_draft_tokens": 5}
    rows = [
        {"batch_size": 1, "sampling": "greedy", "spec": spec},
        {
            "batch_size": 1,
            "sampling": "greedy",
            "context": 40,
            "spec": {"num_speculative_tokens": 1, "top_k": 1, "num_draft_tokens": 2},
        },
        {"batch_size": 2, "sampling": "greedy", "context": 40, "spec": None},
    ]
    user = dict(data, device_name=prof.device_key("cpu"), spec=spec, shapes=rows)
    fresh_cache.mkdir(parents=True)
    (
        fresh_cache / prof.profile_name(data["target"], data["drafter"], prof.device_key("cpu"), "float32", "torch")
    ).write_text(json.dumps(user))
    rt = ts.SpeculativeRuntime.from_pretrained(t, d, max_batch_size=2, max_seq_len=256)
    short, long = "def f(x):", "def f(x):\n    return x + 1\n\n" * 6
    n_short, n_long = (len(rt.tokenizer(p)["input_ids"]) for p in (short, long))
    assert n_short < 40 <= n_long
    a = rt.generate(short, max_new_tokens=8)
    assert a.stats.spec == C(4) and a.stats.spec_source == "profile"
    b = rt.generate(long, max_new_tokens=8)
    assert b.stats.spec == C(1) and b.stats.spec_source == "profile, context >= 40"
    c = rt.generate([short, long], max_new_tokens=8)  # the longest prompt decides the batch's bucket
    assert c.stats.spec is None and c.stats.spec_source == "profile, context >= 40"
    for out, prompts in ((a, short), (b, long), (c, [short, long])):
        assert out.token_ids == rt.generate(prompts, max_new_tokens=8, speculative=False).token_ids


def test_runtime_without_profile_runs_the_rule_per_request(tuned_dir):
    model, drafter = perm_pair("llama", vocab=24, seed=3, alpha=0.3)
    rt = runtime(model, drafter, spec=None, max_batch_size=8)
    assert rt.shape_policy.source == "heuristic"
    prompts = random_prompts(24, [5, 7, 4, 6, 5, 8, 3, 6], seed=2)
    for n, greedy, want in (
        (1, True, ts.SpecConfig(3, 2, 7)),
        (2, True, C(3)),
        (4, True, C(1)),
        (8, True, None),
        (1, False, C(4)),
        (8, False, None),
    ):
        kw = {} if greedy else dict(temperature=1.0, seed=5)
        out = rt.generate(prompts[:n], max_new_tokens=6, **kw)
        assert out.stats.spec == want and out.stats.spec_source == "heuristic", (n, greedy)
        if want is None:
            assert out.stats.num_drafts == 0  # plain decoding
        else:
            # the batch's first rounds run the shape; rows left alone later may run the narrower batch's
            # (test_rows_shape.py), whose depth extends the per-position counts
            assert out.stats.num_drafts > 0 and out.stats.rounds_per_shape.get(want.label, 0) >= 1
            assert len(out.stats.accepted_per_position) >= want.num_speculative_tokens
        if greedy:  # whatever the shape, greedy output is the target's
            assert out.token_ids == rt.generate(prompts[:n], max_new_tokens=6, speculative=False).token_ids
    pinned = runtime(model, drafter, spec=C(2), max_batch_size=8).generate(prompts, max_new_tokens=4)
    assert pinned.stats.spec == C(2) and pinned.stats.spec_source == "caller"
    plain = rt.generate(prompts[:1], max_new_tokens=4, speculative=False)
    assert plain.stats.spec is None and plain.stats.spec_source == "speculative=False"
    rt.spec = C(1)  # setting the spec pins it, as passing spec= does
    assert rt.generate(prompts[:4], max_new_tokens=4).stats.spec == C(1)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """No user profiles: TRITONSPEC_TUNED_DIR unset, the user cache an empty folder."""
    monkeypatch.delenv(store.ENV_DIR, raising=False)
    monkeypatch.setenv("TRITONSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tuned"


def _shipped_here(monkeypatch, tmp_path, variant):
    """The shipped profile of a demo variant, as this machine looks it up. When this CPU is of
    another kind than the one the shipped profiles were measured on, the test looks at a copy of
    them under this CPU's kind (it checks the lookup, not the kind)."""
    t, d = ts.demo_pair(variant)
    tm = ts.TargetModel.from_pretrained(t)
    dr = ts.Eagle3Drafter.from_pretrained(d)
    tfp, dfp = prof.target_fingerprint(tm), prof.drafter_fingerprint(dr)
    shipped = sorted(prof.SHIPPED_DIR.glob(f"tree_shape,target={tfp},drafter={dfp},*.json"))
    assert shipped, f"no shipped profile for the demo pair {variant} in {prof.SHIPPED_DIR}"
    name = prof.profile_name(tfp, dfp, prof.device_kind("cpu"), "float32", "torch")
    if not (prof.SHIPPED_DIR / name).exists():
        copy = tmp_path / "shipped"
        copy.mkdir(exist_ok=True)
        shutil.copy(shipped[0], copy / name)
        monkeypatch.setattr(prof, "SHIPPED_DIR", copy)
    return t, d, prof.SHIPPED_DIR / name, tm


def test_fresh_cache_picks_the_shipped_profile_and_a_user_profile_overrides_it(fresh_cache, tmp_path, monkeypatch):
    t, d, shipped, tm = _shipped_here(monkeypatch, tmp_path, "eagle3.1")
    data = prof.read_profile(shipped)
    assert {(r["batch_size"], r["sampling"]) for r in data["shapes"]} >= {(4, "greedy"), (1, "sampled")}
    rt = ts.SpeculativeRuntime.from_pretrained(t, d, max_batch_size=4, max_seq_len=512)
    assert rt.shape_policy.source == "shipped profile" and rt.shape_policy.path == str(shipped)
    rows = {(r["batch_size"], r["sampling"]): r["spec"] for r in data["shapes"] if not r.get("context")}  # short
    row1 = rows.get((1, "greedy"), data["spec"])  # a measured batch-1 row wins over the model's choice
    assert rt.shape_policy.choose(1, True).spec == (prof.SpecConfig(**row1) if row1 else None)
    want4 = prof.SpecConfig(**rows[4, "greedy"]) if rows[4, "greedy"] else None
    out = rt.generate(["def f(x):"] * 4, max_new_tokens=4)
    assert out.stats.spec == want4 and out.stats.spec_source == "shipped profile"

    # a user profile for this exact device overrides the shipped one
    user = dict(
        data,
        device_name=prof.device_key("cpu"),
        spec={"num_speculative_tokens": 2, "top_k": 1, "num_draft_tokens": 3},
        shapes=[],
    )
    name = prof.profile_name(data["target"], data["drafter"], prof.device_key("cpu"), "float32", "torch")
    fresh_cache.mkdir(parents=True)
    (fresh_cache / name).write_text(json.dumps(user))
    rt = ts.SpeculativeRuntime.from_pretrained(t, d, max_batch_size=4, max_seq_len=512)
    assert rt.shape_policy.source == "profile" and rt.spec == C(2)

    # a corrupt user profile warns and falls back to the shipped one
    (fresh_cache / name).write_text("{broken")
    with pytest.warns(store.TunedConfigWarning, match="ignoring the tuned tree profile"):
        rt = ts.SpeculativeRuntime.from_pretrained(t, d, max_batch_size=4, max_seq_len=512)
    assert rt.shape_policy.source == "shipped profile"

    # so does a float where an integer belongs, and a profile tuned by another release
    for bad, match in (
        (dict(user, spec={"num_speculative_tokens": 2.5, "top_k": 1, "num_draft_tokens": 3}), "integers"),
        (dict(user, versions={"tritonspec": "0.0.1"}), "another|tuned with tritonspec 0.0.1"),
        (dict(user, shapes=[{"batch_size": 2.0, "sampling": "greedy", "spec": None}]), "batch_size"),
    ):
        (fresh_cache / name).write_text(json.dumps(bad))
        with pytest.warns(store.TunedConfigWarning, match=match):
            assert ts.SpeculativeRuntime.from_pretrained(t, d, max_seq_len=512).shape_policy.source == "shipped profile"


def test_cli_stats_line_names_the_shape_and_its_source(fresh_cache, tmp_path, monkeypatch, capsys):
    from tritonspec.cli import main

    _shipped_here(monkeypatch, tmp_path, "eagle3.1")
    assert main(["generate", "def f(x):", "--target", "demo", "--max-new-tokens", "4"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "spec_source=shipped-profile" in line and "spec=(" in line
    assert (
        main(
            [
                "generate",
                "def f(x):",
                "--target",
                "demo",
                "--max-new-tokens",
                "4",
                "--num-speculative-tokens",
                "2",
                "--draft-top-k",
                "1",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "spec=(2,1,3)" in line and "spec_source=caller" in line


def test_a_profile_of_another_vector_isa_of_this_architecture_is_the_fallback(fresh_cache, tmp_path, monkeypatch):
    """No profile for this exact CPU or its kind: one of the same architecture with another ISA
    (say avx2 on an avx512 CPU) applies, and the source names it; another architecture's never does."""
    t, d = ts.demo_pair("eagle3.1")
    tm, dr = ts.TargetModel.from_pretrained(t), ts.Eagle3Drafter.from_pretrained(d)
    tfp, dfp = prof.target_fingerprint(tm), prof.drafter_fingerprint(dr)
    src = sorted(prof.SHIPPED_DIR.glob(f"tree_shape,target={tfp},drafter={dfp},*.json"))[0]
    data = prof.read_profile(src)
    arch = prof.device_kind("cpu").rsplit("-", 1)[0]
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(prof, "SHIPPED_DIR", shipped)
    other_arch = dict(
        data,
        device_name="cpu-otherarch-neon",
        spec={"num_speculative_tokens": 2, "top_k": 1, "num_draft_tokens": 3},
        shapes=[],
    )
    (shipped / prof.profile_name(tfp, dfp, "cpu-otherarch-neon", "float32", "torch")).write_text(json.dumps(other_arch))
    assert ts.SpeculativeRuntime.from_pretrained(t, d, max_seq_len=512).shape_policy.source == "heuristic"
    isa = dict(
        data,
        device_name=f"{arch}-fakeisa",
        spec={"num_speculative_tokens": 5, "top_k": 1, "num_draft_tokens": 6},
        shapes=[],
    )
    (shipped / prof.profile_name(tfp, dfp, f"{arch}-fakeisa", "float32", "torch")).write_text(json.dumps(isa))
    rt = ts.SpeculativeRuntime.from_pretrained(t, d, max_seq_len=512)
    assert rt.shape_policy.source == f"shipped profile ({arch}-fakeisa)" and rt.spec == C(5)
    own = dict(
        isa, device_name=prof.device_kind("cpu"), spec={"num_speculative_tokens": 3, "top_k": 1, "num_draft_tokens": 4}
    )
    (shipped / prof.profile_name(tfp, dfp, prof.device_kind("cpu"), "float32", "torch")).write_text(json.dumps(own))
    rt = ts.SpeculativeRuntime.from_pretrained(t, d, max_seq_len=512)
    assert rt.shape_policy.source == "shipped profile" and rt.spec == C(3)  # this kind's own wins


def test_compiled_rounds_read_their_own_profile_first(fresh_cache, tmp_path, monkeypatch):
    """A runtime with compiled CPU rounds (``compile=True``) takes a ``rounds=compiled`` profile
    before the eager one; an eager runtime never reads a compiled one; with no compiled profile a
    compiled runtime falls back to the eager profile."""
    t, d, shipped, tm = _shipped_here(monkeypatch, tmp_path, "eagle3.1")
    data = prof.read_profile(shipped)
    only_eager = tmp_path / "only_eager"  # the shipped eager profile alone (whatever else ships)
    only_eager.mkdir()
    shutil.copy(shipped, only_eager / shipped.name)
    monkeypatch.setattr(prof, "SHIPPED_DIR", only_eager)
    tfp, dfp, dev = data["target"], data["drafter"], prof.device_key("cpu")
    fresh_cache.mkdir(parents=True)
    eager_name = prof.profile_name(tfp, dfp, dev, "float32", "torch")
    compiled_name = prof.profile_name(tfp, dfp, dev, "float32", "torch", "compiled")
    assert compiled_name.endswith(",backend=torch,rounds=compiled.json") and eager_name.endswith(",backend=torch.json")

    def profile(depth):
        spec = {"num_speculative_tokens": depth, "top_k": 1, "num_draft_tokens": depth + 1}
        return json.dumps(dict(data, device_name=dev, spec=spec, shapes=[]))

    (fresh_cache / compiled_name).write_text(profile(5))

    def build(compile):
        return ts.SpeculativeRuntime.from_pretrained(t, d, max_batch_size=1, max_seq_len=256, compile=compile)

    rt = build(True)
    assert rt.spec == C(5) and rt.shape_policy.source == "profile (compiled rounds)"
    assert build(False).shape_policy.source == "shipped profile"  # eager rounds never read it
    (fresh_cache / eager_name).write_text(profile(2))
    assert build(False).spec == C(2) and build(True).spec == C(5)
    (fresh_cache / compiled_name).unlink()
    rt = build(True)  # no compiled profile: the eager one
    assert rt.spec == C(2) and rt.shape_policy.source == "profile"
    with pytest.raises(ValueError, match="rounds="):
        prof.profile_name(tfp, dfp, dev, "float32", "torch", "graphs")


def test_amx_targets_are_a_kind_of_their_own_that_other_targets_never_fall_back_to(fresh_cache, tmp_path, monkeypatch):
    """A bfloat16 target on AMX-packed weights looks up ``<kind>_amx`` profiles (AMX verifies many rows
    cheaply, so its trees are larger); a target without AMX never takes such a profile as its
    fallback (it would verify those rows at ~2.5 one-row steps), while an AMX target may fall back
    to a profile of its CPU's plain kind."""
    from tritonspec.kernels import cpu_linear as cl

    kind = prof.device_kind("cpu")
    assert prof.device_kind("cpu", "amx") == kind + prof.AMX_SUFFIX
    assert prof.device_names("cpu", "nk") == (prof.device_key("cpu"), kind)
    assert prof.device_names("cpu", "amx") == (prof.device_key("cpu") + "_amx", kind + "_amx")
    t, d = ts.demo_pair("eagle3.1")
    dr = ts.Eagle3Drafter.from_pretrained(d)  # the fingerprint does not depend on its dtype
    nk = ts.TargetModel.from_pretrained(t, dtype=torch.bfloat16, weight_layout="nk")
    tfp, dfp = prof.target_fingerprint(nk), prof.drafter_fingerprint(dr)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(prof, "SHIPPED_DIR", shipped)
    base = {"kind": prof.KIND, "target": tfp, "drafter": dfp, "dtype": "bfloat16", "backend": "torch", "shapes": []}
    amx_name = prof.profile_name(tfp, dfp, kind + "_amx", "bfloat16", "torch")
    spec = {"num_speculative_tokens": 3, "top_k": 2, "num_draft_tokens": 9}
    (shipped / amx_name).write_text(json.dumps(dict(base, device_name=kind + "_amx", spec=spec)))
    assert prof.candidate_profiles(nk, dr, "torch") == []  # not even as another ISA's profile
    assert prof.shape_policy(nk, dr, "torch").source == "heuristic"
    if cl.amx_available() is not None:
        pytest.skip(f"the AMX half needs AMX here: {cl.amx_available()}")
    amx = ts.TargetModel.from_pretrained(t, dtype=torch.bfloat16, weight_layout="amx")
    assert prof.target_fingerprint(amx) == tfp
    assert prof.candidate_profiles(amx, dr, "torch") == [shipped / amx_name]
    policy = prof.shape_policy(amx, dr, "torch")
    assert policy.source == "shipped profile" and policy.choose(1, True).spec == ts.SpecConfig(3, 2, 9)
    (shipped / amx_name).unlink()  # only a profile of the plain kind: the AMX target's fallback
    plain = {"num_speculative_tokens": 2, "top_k": 1, "num_draft_tokens": 3}
    (shipped / prof.profile_name(tfp, dfp, kind, "bfloat16", "torch")).write_text(
        json.dumps(dict(base, device_name=kind, spec=plain))
    )
    assert prof.shape_policy(amx, dr, "torch").source == f"shipped profile ({kind})"


def test_every_shipped_profile_names_a_shipped_drafter():
    """A drafter retrained and shipped without its profiles re-keyed leaves them stale: they would
    silently never apply (the lookup is by the drafter's content fingerprint). Every shipped profile
    must name a shipped drafter (the demo's or a ``drafters/`` one), in its file name and its data, and
    read back; every shipped drafter must have at least one profile."""
    dirs = [ts.demo.demo_pair(v)[1] for v in ("eagle3", "eagle3.1")]
    dirs += [d for v in ts.drafters.VARIANTS if (d := ts.shipped_drafter("smollm2", v)) is not None]
    shipped = {prof.drafter_fingerprint(ts.Eagle3Drafter.from_pretrained(d)): d for d in dirs}
    files = sorted(prof.SHIPPED_DIR.glob("tree_shape,*.json"))
    assert files
    named = set()
    for f in files:
        data = prof.read_profile(f)
        assert f"drafter={data['drafter']}," in f.name, f.name
        assert data["drafter"] in shipped, f"{f.name}: no shipped drafter has fingerprint {data['drafter']}"
        named.add(data["drafter"])
    assert named == set(shipped), {shipped[d].name for d in set(shipped) - named}


@pytest.mark.parametrize(
    "prompt, new, most, ratio, want",
    [
        (786, 4, 4, 0.027, False),  # 4 < 21.2
        (786, 22, 22, 0.027, True),
        (58, 2, 2, 0.027, True),  # a short prompt pays from two tokens
        (58, 1, 1, 0.027, False),  # one token: the prompt's forward gives it
        (8 * 58, 8, 1, 0.0, False),  # one token a prompt, whatever the total
        (3513, 96, 12, 0.027, True),  # summed over the prompts: 96 >= 94.9
        (3513, 94, 12, 0.027, False),
    ],
)
def test_the_drafters_prompt_pass_must_pay(prompt, new, most, ratio, want):
    assert prompt_pass_pays(prompt, new, most, ratio) is want


def test_prompt_pass_ratio_scales_with_the_drafters_flops_over_the_targets_bytes():
    r = prompt_pass_ratio(2e6, 1e8)
    assert r == pytest.approx(PROMPT_PASS_BYTES_PER_FLOP * 0.02)
    assert prompt_pass_ratio(4e6, 1e8) == pytest.approx(2 * r) and prompt_pass_ratio(2e6, 2e8) == pytest.approx(r / 2)


def test_a_short_request_on_a_long_prompt_decodes_plainly(fresh_cache, tmp_path, monkeypatch):
    """The demo pair (its shipped profile): a 786-token prompt asking for 4 tokens decodes plainly (the drafter's
    pass over the prompt would not pay; the stats say why) with plain decoding's tokens; asking for 40 it
    speculates (inverse), and so does a short prompt asking for 4, and a caller's spec always runs."""
    t, d, _, _ = _shipped_here(monkeypatch, tmp_path, "eagle3.1")
    rt = ts.SpeculativeRuntime.from_pretrained(t, d, max_batch_size=1, max_seq_len=1024, backend="torch")
    ratio = rt._prompt_pass_ratio
    assert 0.01 < ratio < 0.05  # the demo pair's: the calibration's own pair
    long = ts.demo.prompt_set("standard")[0]["prompt"]
    n_long = len(rt.tokenizer(long)["input_ids"])
    assert 4 < ratio * n_long < 40
    few = rt.generate(long, max_new_tokens=4)
    assert few.stats.spec is None and few.stats.spec_source.startswith("plain: 4 new token(s)")
    assert few.stats.num_drafts == 0
    assert few.token_ids == rt.generate(long, max_new_tokens=4, speculative=False).token_ids
    many = rt.generate(long, max_new_tokens=40)
    assert many.stats.spec is not None and many.stats.num_drafts > 0
    short = rt.generate("def add(a, b):", max_new_tokens=4)
    assert short.stats.spec is not None and short.stats.num_drafts > 0
    pinned = ts.SpeculativeRuntime.from_pretrained(t, d, max_batch_size=1, max_seq_len=1024, spec=C(3), backend="torch")
    one = pinned.generate(long, max_new_tokens=4)
    assert one.stats.spec == C(3) and one.stats.spec_source == "caller" and one.stats.num_drafts > 0
