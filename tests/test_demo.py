"""The bundled demo pair, its prompt sets, and the recipe that builds them."""

from __future__ import annotations

import json

import pytest

import tritonspec as ts
from tritonspec import demo
from tritonspec.recipes.demo.corpus import is_heldout, list_corpus
from tritonspec.recipes.demo.prompt_sets import chat_wrap, tabs_for_spaces

needs_demo = pytest.mark.skipif(not demo.available(), reason="demo weights not built (run the demo recipe)")


def test_demo_pair_rejects_unknown_variant():
    with pytest.raises(ValueError, match="eagle3.1"):
        ts.demo_pair("eagle2")


def test_heldout_split_is_by_path_hash_only():
    assert is_heldout("a/b.py", 100) and not is_heldout("a/b.py", 0)
    files = list_corpus(heldout_percent=5)
    assert files == sorted(files, key=lambda f: f.relpath)
    held = [f for f in files if f.heldout]
    assert 0 < len(held) < len(files) // 5
    assert all(is_heldout(f.relpath, 5) for f in held)
    assert not any(part in ("test", "tests", "site-packages") for f in files for part in f.relpath.split("/")[:-1])


def test_perturbations():
    assert tabs_for_spaces("if x:\n    y = 1\n      z\n") == "if x:\n\ty = 1\n\t  z\n"
    wrapped = chat_wrap("x = 1\n", "m.py", "# hdr\n")
    assert wrapped.startswith("<|user|>") and wrapped.endswith("```python\n# hdr\nx = 1\n")


@needs_demo
def test_bundle_size_manifest_and_prompt_sets():
    ours = [demo.ROOT / d / "model.safetensors" for d in ("target", *demo.VARIANTS.values())]
    assert all(p.exists() for p in ours)
    assert sum(p.stat().st_size for p in demo.ROOT.rglob("*.safetensors")) <= 40e6  # everything bundled
    manifest = json.loads((demo.ROOT / "manifest.json").read_text())
    assert manifest["config"]["seed"] == 0 and manifest["corpus"]["files"]
    assert all(len(f["sha256"]) == 64 for f in manifest["corpus"]["files"])
    heldout = {f["relpath"] for f in manifest["corpus"]["files"] if f["heldout"]}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo.ROOT / "target"))
    for name in demo.PROMPT_SETS:
        rows = demo.prompt_set(name)
        assert 50 <= len(rows) <= 200
        assert {r["source"] for r in rows} <= heldout
    assert min(len(tok(r["prompt"])["input_ids"]) for r in demo.prompt_set("long")) >= 1500
    perturbed = [r["prompt"] for r in demo.prompt_set("perturbed")]
    assert all(p.startswith("<|user|>") and "\n    " not in p for p in perturbed)  # chat wrapper, no 4-space indents
    assert sum("\t" in p for p in perturbed) > len(perturbed) // 2


@needs_demo
@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_demo_pair_runs_losslessly_and_accepts(variant):
    tdir, ddir = ts.demo_pair(variant)
    d = ts.Eagle3Drafter.from_pretrained(ddir)
    assert d.config.fc_norm is d.config.norm_output is (variant == "eagle3.1")
    # a wide tree shows what the drafter accepts (the shipped profile's small shapes are tuned for speed)
    rt = ts.SpeculativeRuntime.from_pretrained(tdir, d, backend="torch", max_seq_len=2048, spec=ts.SpecConfig())
    prompt = demo.prompt_set("standard")[0]["prompt"]
    spec = rt.generate(prompt, max_new_tokens=24)
    plain = rt.generate(prompt, max_new_tokens=24, speculative=False)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.mean_acceptance_length > 1.5  # a trained drafter, not a random one


@pytest.mark.slow
def test_recipe_smoke_budget_builds_a_loadable_bundle(tmp_path):
    from tritonspec.recipes import demo as recipe

    out = recipe.run(tmp_path / "out", tmp_path / "work", budget="smoke")
    assert (out / "manifest.json").exists()
    tdir, ddir = out / "target", out / "drafter-eagle3.1"
    rt = ts.SpeculativeRuntime.from_pretrained(tdir, ddir, backend="torch", max_seq_len=256)
    r = rt.generate("def f(x):", max_new_tokens=8)
    assert r.token_ids == rt.generate("def f(x):", max_new_tokens=8, speculative=False).token_ids
    # the long-context records (prompt + continuation = one long window) reached the drafters' training
    cfg = recipe.BUDGETS["smoke"]
    long_records = [json.loads(line) for line in (tmp_path / "work" / "regen_long.jsonl").open()]
    assert len(long_records) == cfg.regen_long_samples
    assert {len(r["input_ids"]) for r in long_records} == {cfg.regen_long_prompt_tokens + cfg.regen_new_tokens}
    for variant in ("eagle3", "eagle3.1"):
        args = json.loads((out / f"drafter-{variant}" / "training_args.json").read_text())
        assert args["train_config"]["long_seq_len"] == cfg.drafter_long_seq_len


def test_recipe_config_rejects_long_records_that_would_be_cut_as_short_ones():
    """A long record of at most half a long window would train as short windows only: refused, with the fix."""
    from tritonspec.recipes.demo import RecipeConfig

    with pytest.raises(ValueError, match="raise regen_long_prompt_tokens"):
        RecipeConfig(regen_long_prompt_tokens=100, regen_new_tokens=28, drafter_long_seq_len=2040)
    assert RecipeConfig(regen_long_samples=0, regen_long_prompt_tokens=100).regen_long_samples == 0


@pytest.mark.parametrize("name,rows", [("standard", 16), ("long", 8)])
def test_demo_tuning_prompts_share_no_file_with_a_benchmark_prompt(name, rows):
    """``demo.tuning_prompts`` (what `autotune tree --target demo` tunes on) come from the set of that
    name, after its benchmark rows, one per file, and from files that no benchmark row of any set
    (the first ``BENCH_ROWS``) comes from; the inverse: a benchmark row slipped in is caught."""
    tune = demo.tuning_prompts(name)
    full = {r["id"]: r for r in demo.prompt_set(name)}
    bench = {r["source"] for s in demo.PROMPT_SETS for r in demo.prompt_set(s)[: demo.BENCH_ROWS]}
    assert len(tune) == rows and len({r["source"] for r in tune}) == rows
    assert all(full[r["id"]] == r for r in tune)  # rows of the set itself, unchanged
    assert not bench & {r["source"] for r in tune}
    with pytest.raises(ValueError, match="tuning set"):
        demo.tuning_prompts("perturbed")


class _Tuned(Exception):
    pass


def test_autotune_tree_on_the_demo_tunes_on_the_tuning_prompts(monkeypatch):
    """``autotune tree --target demo`` hands the tuner ``demo.tuning_prompts()`` (the first
    ``--num-prompts``), and ``--long-prompts demo`` the long ones: not the benchmark's rows."""
    from tritonspec.autotune import tree_tuner
    from tritonspec.cli import main

    if not demo.available():
        pytest.skip("the demo pair is not built")
    seen = {}

    def tune(target, drafter, prompts, **kw):
        seen.update(prompts=prompts, long=kw["long_prompts"])
        raise _Tuned

    monkeypatch.setattr(tree_tuner, "tune_tree", tune)
    with pytest.raises(_Tuned):
        main(["autotune", "tree", "--target", "demo", "--num-prompts", "5", "--long-prompts", "demo"])
    assert seen["prompts"] == [r["prompt"] for r in demo.tuning_prompts("standard")[:5]]
    assert seen["long"] == [r["prompt"] for r in demo.tuning_prompts("long")[:4]]
    bench = {r["prompt"] for s in demo.PROMPT_SETS for r in demo.prompt_set(s)[: demo.BENCH_ROWS]}
    assert not bench & {*seen["prompts"], *seen["long"]}


def test_autotune_long_prompts_demo_needs_the_demo_target(tmp_path, capsys):
    """``--long-prompts demo`` names the demo pair's long tuning rows: with another target it is an
    error that says so (exit status 2)."""
    from tritonspec.cli import main

    argv = ["autotune", "tree", "--target", str(tmp_path), "--drafter", str(tmp_path), "--long-prompts", "demo"]
    assert main(argv) == 2
    assert "--long-prompts demo names the demo pair's long tuning prompts" in capsys.readouterr().err


def test_autotune_prompt_lookup_min_reaches_the_tuner_and_needs_a_branch(monkeypatch, capsys):
    """``--prompt-lookup 4 --prompt-lookup-min 1,2`` passes both lists to ``tune_tree``; a minimum
    without ``--prompt-lookup`` is an error that says what to add (exit status 2)."""
    from tritonspec.autotune import tree_tuner
    from tritonspec.cli import main

    if not demo.available():
        pytest.skip("the demo pair is not built")
    seen = {}

    def tune(target, drafter, prompts, **kw):
        seen.update(lookup=kw["prompt_lookup"], mins=kw["prompt_lookup_min"])
        raise _Tuned

    monkeypatch.setattr(tree_tuner, "tune_tree", tune)
    with pytest.raises(_Tuned):
        main(["autotune", "tree", "--target", "demo", "--prompt-lookup", "4", "--prompt-lookup-min", "1,2"])
    assert seen == {"lookup": [4], "mins": [1, 2]}
    assert main(["autotune", "tree", "--target", "demo", "--prompt-lookup-min", "1"]) == 2
    assert "needs --prompt-lookup" in capsys.readouterr().err


def test_evaluate_report_names_the_command_that_reproduces_it():
    """``demo/RESULTS.md``'s header gives the evaluate command with the tree flags of a non-default shape
    (none for the default tree), and states the machine's cores rather than assuming shared ones."""
    import os

    from tritonspec.runtime.config import SpecConfig
    from tritonspec.training.evaluate import SetResult, render

    rows = [SetResult("standard", v, 2, 3.0, 10.0, 8.0, True, [2, 1], 4) for v in ("eagle3", "eagle3.1")]
    small = render(rows, 2, 16, SpecConfig(4, 2, 8), None)
    assert "--n 2 --max-new-tokens 16 --num-speculative-tokens 4 --draft-top-k 2 --num-draft-tokens 8`" in small
    assert f"{os.cpu_count()} CPU cores;" in small and "shared with other work" not in small
    default = render(rows, 2, 16, SpecConfig(6, 8, 48), None)
    assert "--n 2 --max-new-tokens 16` on" in default and "| standard | 3.00 | 3.00 | 8.0 |" in default
