"""perf/compare_drafters.py: drafters side by side on the demo pair (τ, vocabulary coverage, identical outputs)
and its input errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tritonspec as ts

from _util import perf_module

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "demo"


@pytest.fixture(scope="module")
def cmp():
    return perf_module("compare_drafters")


@pytest.fixture
def prompts_file(tmp_path):
    rows = [json.loads(line) for line in (DEMO / "prompts" / "standard.jsonl").read_text().splitlines()[:3]]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["prompt"][-400:]}) + "\n" for r in rows))
    return path


def run_main(cmp, prompts_file, tmp_path, *drafters, extra=()):
    out = tmp_path / "c.json"
    argv = [*drafters, "--target", str(DEMO / "target"), "--sets", str(prompts_file), "--n", "2", "--tokens", "6"]
    rc = cmp.main([*argv, "--shapes", "2,1,2,0;3,2,5,2", "--threads", "1", "--json", str(out), *extra])
    return rc, json.loads(out.read_text())["rows"]


def test_side_by_side_on_the_demo_pair(cmp, prompts_file, tmp_path, capsys):
    rc, rows = run_main(
        cmp,
        prompts_file,
        tmp_path,
        f"e3={DEMO / 'drafter-eagle3'}",
        f"e31={DEMO / 'drafter-eagle3.1'}",
        f"again={DEMO / 'drafter-eagle3'}",
    )
    assert rc == 0
    assert [(r["shape"], r["drafter"]) for r in rows] == [
        (s, d) for s in ("(2,1,2)+lookup0", "(3,2,5)+lookup2") for d in ("e3", "e31", "again")
    ]
    for r in rows:
        assert r["prompts"] == 2 and r["identical"] is True
        assert 1.0 <= r["tau"] <= 1 + 3 and 0.0 <= r["coverage"] <= 1.0
    by = {(r["shape"], r["drafter"]): r["tau"] for r in rows}
    for s in ("(2,1,2)+lookup0", "(3,2,5)+lookup2"):  # the same drafter twice: the same proposals, the same τ
        assert by[(s, "e3")] == by[(s, "again")]
    assert max(by.values()) > 1.0  # some drafts were accepted: the τ is a drafter's, not a constant 1
    assert "OUTPUTS DIFFER" not in capsys.readouterr().out


def test_sampled_side_by_side_pools_tau_and_skips_the_identity_check(cmp, prompts_file, tmp_path, capsys):
    """``--temperature``: each prompt sampled with ``--seed``; sampled outputs follow the drafter, so ``identical``
    is None (not a failure), and ``tau_pooled`` is tokens / rounds over the set (at most the mean τ)."""
    drafters = (f"e3={DEMO / 'drafter-eagle3'}", f"again={DEMO / 'drafter-eagle3'}")
    rc, rows = run_main(cmp, prompts_file, tmp_path, *drafters, extra=("--temperature", "1", "--seed", "3"))
    assert rc == 0
    for r in rows:
        assert r["identical"] is None
        assert 1.0 <= r["tau_pooled"] <= r["tau"] + 1e-9
    by = {(r["shape"], r["drafter"]): r["tau_pooled"] for r in rows}
    for s in ("(2,1,2)+lookup0", "(3,2,5)+lookup2"):  # the same drafter and seed twice: the same draws
        assert by[(s, "e3")] == by[(s, "again")]
    assert "OUTPUTS DIFFER" not in capsys.readouterr().out


def test_differing_outputs_are_reported(cmp, prompts_file, tmp_path, monkeypatch, capsys):
    """The inverse: if one drafter's run emitted other tokens (a losslessness bug), the row says so and the
    script exits 1."""
    real = ts.SpeculativeRuntime.generate
    calls = {"n": 0}

    def generate(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] % 2 == 0:  # the second drafter of each prompt
            out.token_ids[0][-1] = (out.token_ids[0][-1] + 1) % 100
        return out

    monkeypatch.setattr(ts.SpeculativeRuntime, "generate", generate)
    rc, rows = run_main(cmp, prompts_file, tmp_path, f"a={DEMO / 'drafter-eagle3'}", f"b={DEMO / 'drafter-eagle3.1'}")
    assert rc == 1 and calls["n"] > 0
    assert not any(r["identical"] for r in rows)
    assert "OUTPUTS DIFFER ACROSS DRAFTERS" in capsys.readouterr().out


def test_bad_inputs_name_the_problem(cmp, tmp_path):
    with pytest.raises(SystemExit, match="want NAME=DIR"):
        cmp.parse_drafters(["demo/drafter-eagle3"])
    with pytest.raises(SystemExit, match="holds no config.json"):
        cmp.parse_drafters([f"x={tmp_path}"])
    with pytest.raises(SystemExit, match="given twice"):
        cmp.parse_drafters([f"x={DEMO / 'drafter-eagle3'}", f"x={DEMO / 'drafter-eagle3.1'}"])
    with pytest.raises(SystemExit, match="four integers"):
        cmp.parse_shapes("3,2,7")
    with pytest.raises(SystemExit, match="no shape"):
        cmp.parse_shapes(" ; ")
    with pytest.raises(SystemExit, match="neither 'humaneval'"):
        cmp.load_set("no-such-set", 4)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    with pytest.raises(SystemExit, match="row 1 has neither"):
        cmp.load_set(str(bad), 4)
    with pytest.raises(SystemExit, match="no prompts in rows 5"):
        cmp.load_set(str(bad), 4, start=5)


def test_sets_and_shapes_parse(cmp, tmp_path):
    f = tmp_path / "s.jsonl"
    f.write_text('{"prompt": "a b"}\n{"messages": [{"role": "user", "content": "hi"}]}\n{"prompt": "c"}\n')
    assert cmp.load_set(str(f), 2, start=1) == [[{"role": "user", "content": "hi"}], "c"]
    chat = cmp.load_set("chat", 3)  # the bundled SmolLM2 chat set, as chat messages
    assert len(chat) == 3 and all(isinstance(p, list) and p[-1]["role"] == "user" for p in chat)
    (s,) = cmp.parse_shapes("5,2,12,4")
    assert (s.num_speculative_tokens, s.top_k, s.num_draft_tokens, s.prompt_lookup_num_tokens) == (5, 2, 12, 4)
