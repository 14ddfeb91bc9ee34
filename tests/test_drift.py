"""Attention-drift diagnostics on constructed drafters with known attention patterns."""

from __future__ import annotations

import json

import pytest
import torch

import tritonspec as ts
from tritonspec.runtime.drift import DriftRecorder, measure_drift, write_report
from tritonspec.runtime.metadata import AttentionMetadata, KVCache

from _util import perm_pair, random_prompts, runtime, tiny_target

CHAIN = ts.SpecConfig.chain(4)


def uniform_drafter(model, **flags):
    """Zero key projection: every visible slot gets the same score, so attention is uniform."""
    d = ts.Eagle3Drafter.for_target(model.config, seed=1, **flags)
    with torch.no_grad():
        d.midlayer.self_attn.k_proj.weight.zero_()
    return d


def test_uniform_attention_gives_counting_shares():
    model = tiny_target("llama", seed=1, vocab_size=24)
    prompt = random_prompts(24, [10], seed=0)[0]
    rep = measure_drift(model, [uniform_drafter(model)], [prompt], spec=CHAIN, max_new_tokens=2, n_sink=1)
    d = rep.drafters[0]
    # one round after a 10-token prompt: the committed prefix has 10 slots; depth k sees k-1 drafted slots
    for k in range(1, 5):
        visible = 10 + (k - 1)
        assert d.attn_sink[k - 1] == pytest.approx(1 / visible, abs=1e-6)
        assert d.attn_context[k - 1] == pytest.approx(9 / visible, abs=1e-6)
        assert d.attn_drafted[k - 1] == pytest.approx((k - 1) / visible, abs=1e-6)
    assert d.samples == [1, 1, 1, 1]


def sink_drafter(model):
    """Queries score only against the first prompt token's key (the sink): every row of the
    drafter's own embedding is the same except the sink token's, the key map sends the common row
    to 0 and the sink row to a large vector on the lowest-frequency rope pair (barely rotated)."""
    d = ts.Eagle3Drafter.for_target(model.config, seed=2)
    c = d.config
    H, hd = c.hidden_size, c.head_dim
    emb = torch.ones(c.vocab_size, H)
    emb[0] = torch.linspace(-2.0, 3.0, H)  # token 0 is the sink
    d.embed_tokens = torch.nn.Embedding.from_pretrained(emb, freeze=True)
    d.has_own_embedding = True
    e_common = torch.ones(H) / (1.0 + 1e-6) ** 0.5  # RMS-normed common row (input_layernorm weight = 1)
    e_sink = emb[0] / emb[0].pow(2).mean().sqrt()
    w = e_sink - (e_sink @ e_common) / (e_common @ e_common) * e_common  # orthogonal to the common row
    w = w / (w @ e_sink)
    lo = hd // 2 - 1  # lowest-frequency rotate-half pair: dims lo and lo + hd/2
    with torch.no_grad():
        a = d.midlayer.self_attn
        a.q_proj.weight.zero_()
        a.k_proj.weight.zero_()
        for h in range(c.num_attention_heads):
            a.q_proj.weight[h * hd + lo, :H] = 30.0 * e_common / (e_common @ e_common)
        for j in range(c.num_key_value_heads):
            a.k_proj.weight[j * hd + lo, :H] = 30.0 * w
    return d


def test_scores_forced_onto_the_sink():
    model = tiny_target("llama", seed=1, vocab_size=24)
    # the drafter pairs slot t with token x_{t+1}: token 0 as x_1 puts it in slot 0, and nowhere else
    prompt = [5, 0] + [t or 1 for t in random_prompts(24, [10], seed=1)[0]]
    rep = measure_drift(model, [sink_drafter(model)], [prompt], spec=CHAIN, max_new_tokens=12)
    d = rep.drafters[0]
    assert min(d.attn_sink) > 0.99 and max(d.attn_drafted) < 0.01


def test_carry_norm_matches_a_direct_computation():
    model, d3 = perm_pair("llama", vocab=24, seed=3, alpha=0.3, fc_norm=False, norm_output=False)
    _, d31 = perm_pair("llama", vocab=24, seed=3, alpha=0.3, fc_norm=False, norm_output=True)
    prompt = random_prompts(24, [9], seed=2)[0]
    rep = measure_drift(model, [d3, d31], [prompt], spec=CHAIN, max_new_tokens=2, names=["e3", "e31"])
    # depth 1 = the drafter's carry at the prompt's last position, recomputed here from scratch
    rt = runtime(model, d3, CHAIN)
    tm, ops = rt.target, rt.ops
    T = len(prompt)
    tm.allocate_cache(1, T + 8)
    pos = torch.arange(T)[None]
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None]
    zero = torch.zeros(1, dtype=torch.int64)
    with torch.no_grad():
        logits_h, aux = tm.forward(ops, torch.tensor([prompt]), AttentionMetadata(pos, pos, zero, causal, T))
        root = tm.logits(logits_h[0, -1]).argmax()
        nxt = torch.tensor([prompt[1:] + [int(root)]])
        for d, curves in ((d3, rep.drafters[0]), (d31, rep.drafters[1])):
            g = d.combine(ops, aux[0], torch.arange(T))[None]
            k = torch.zeros(1, T + 1, d.config.num_key_value_heads, d.config.head_dim)
            hn, carry = d.step(
                ops, g, nxt, AttentionMetadata(pos, pos, zero, causal, T), KVCache(k, torch.zeros_like(k))
            )
            want = carry[0, -1].pow(2).mean().sqrt().item()
            assert curves.carry_rms[0] == pytest.approx(want, rel=1e-5)
    assert rep.drafters[1].carry_rms[0] == pytest.approx(
        d31.norm.weight.pow(2).mean().sqrt().item(), rel=1e-3
    )  # post-norm carry: RMS of the norm weight


def test_measuring_does_not_change_tokens_and_writes_report(tmp_path):
    model, d = perm_pair("llama", vocab=24, seed=4, alpha=0.3)
    prompts = random_prompts(24, [6, 9], seed=3)
    rt = runtime(model, d, CHAIN)
    before = [rt.generate([p], max_new_tokens=20).token_ids[0] for p in prompts]
    rec = DriftRecorder(4)
    with rt.observe(rec):
        during = [rt.generate([p], max_new_tokens=20).token_ids[0] for p in prompts]
    assert before == during
    assert rec.counts.min() > 0, "the observer saw every depth"
    rep = measure_drift(model, [d], prompts, spec=CHAIN, max_new_tokens=20, names=["perm"])
    files = write_report(rep, tmp_path)
    data = json.loads((tmp_path / "drift.json").read_text())
    assert data["drafters"][0]["name"] == "perm" and len(data["drafters"][0]["acceptance"]) == 4
    assert all(f.exists() and f.stat().st_size > 0 for f in files)
    assert {f.name for f in files} >= {"attention.png", "carry_norm.png", "acceptance.png", "summary.txt"}
    a = data["drafters"][0]
    assert all(x >= y for x, y in zip(a["acceptance"], a["acceptance"][1:]))
    for k in range(4):
        assert a["attn_sink"][k] + a["attn_context"][k] + a["attn_drafted"][k] == pytest.approx(1.0, abs=1e-6)


def test_drift_cli(tmp_path, capsys):
    from tritonspec.cli import main
    from tritonspec.runtime.tiny import tiny_random_pair

    t, d = tiny_random_pair(tmp_path / "pair")
    (tmp_path / "p.jsonl").write_text('{"prompt": "def f(x):"}\n{"prompt": "import os"}\n')
    assert (
        main(
            [
                "drift",
                "--target",
                str(t),
                "--drafter",
                str(d),
                "--prompts",
                str(tmp_path / "p.jsonl"),
                "--out",
                str(tmp_path / "out"),
                "--depth",
                "3",
                "--max-new-tokens",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "depth  sink" in out and (tmp_path / "out" / "drift.json").exists()
    assert main(["drift", "--target", str(t), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path)]) == 2


def test_cli_on_the_demo_pair_names_the_drafters_by_variant(tmp_path, capsys):
    """``drift --target demo`` labels the bundled drafters ``eagle3`` / ``eagle3.1`` (the report files are
    committed under ``demo/drift/``: no machine's paths in them); a named ``--drafter`` keeps its path."""
    import json

    from tritonspec import demo
    from tritonspec.cli import main

    if not demo.available():
        pytest.skip("the demo pair is not built")
    (tmp_path / "p.jsonl").write_text('{"prompt": "import os\\n"}\n')
    prompts = str(tmp_path / "p.jsonl")
    argv = ["drift", "--target", "demo", "--prompts", prompts, "--depth", "2", "--max-new-tokens", "4"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    report = json.loads((tmp_path / "a" / "drift.json").read_text())
    assert [d["name"] for d in report["drafters"]] == ["eagle3", "eagle3.1"]
    drafter = str(demo.demo_pair("eagle3.1")[1])
    assert main([*argv, "--drafter", drafter, "--out", str(tmp_path / "b")]) == 0
    report = json.loads((tmp_path / "b" / "drift.json").read_text())
    assert [d["name"] for d in report["drafters"]] == [drafter]
    capsys.readouterr()


def test_read_prompts_formats_and_bad_rows(tmp_path):
    from tritonspec.runtime.drift import read_prompts

    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n"c"\n')
    assert read_prompts(tmp_path / "p.jsonl") == ["a", "b", "c"]
    (tmp_path / "p.txt").write_text("def f():\n    pass\n\n\nimport os\n")
    assert read_prompts(tmp_path / "p.txt", 1) == ["def f():\n    pass"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": 3}\n')
    with pytest.raises(ValueError, match="every row needs a 'prompt' or 'text' string"):
        read_prompts(tmp_path / "bad.jsonl")
