"""Drafter training end to end on tiny models: loss goes down, checkpoints resume, exports reload and
run in the runtime, and bad input fails with a clear error."""

from __future__ import annotations

import json
import math

import pytest
import torch

import tritonspec as ts
from tritonspec.cli import main
from tritonspec.runtime.ops import TorchOps
from tritonspec.runtime.tiny import byte_tokenizer, tiny_target
from tritonspec.training import TrainConfig, train_drafter, train_drafters
from tritonspec.training.data import draft_vocab_from_counts, load_token_sequences, token_windows
from tritonspec.training.trainer import build_drafter, capture
from tritonspec.training.ttt import shift_left, ttt_forward

SMALL = dict(batch_size=2, seq_len=24, ttt_depth=3, lr=3e-3, warmup_steps=2, checkpoint_every=5)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny random target with a byte tokenizer (vocab 257, EOS 256), saved as an HF directory."""
    d = tmp_path_factory.mktemp("target")
    model = tiny_target("llama", seed=0, vocab_size=257, eos_token_id=256)
    model.save_pretrained(str(d))
    byte_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def greedy_data(target_dir):
    """Self-distillation data: the target's own greedy continuations of short random prompts."""
    rt = ts.SpeculativeRuntime.from_pretrained(target_dir, None, backend="torch", max_seq_len=64, max_batch_size=4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (6,), generator=g).tolist() for _ in range(4)]
    out = rt.generate(prompts, max_new_tokens=30, speculative=False, stop_token_ids=[])
    return [p + c for p, c in zip(prompts, out.token_ids)]


def _mean_kl(drafter, tm, windows, depth):
    """Mean over depths of KL(teacher restricted to the draft vocab || drafter) on ``windows``."""
    ops = TorchOps()
    tm.set_aux_layer_ids(drafter.config.aux_layer_ids)
    tm.allocate_cache(windows.shape[0], windows.shape[1])
    aux, logits = capture(tm, ops, windows)
    with torch.no_grad():
        out = ttt_forward(drafter, ops, aux, windows, depth, logits)
    kls = []
    for j, ce in enumerate(out.losses):
        p = torch.softmax(shift_left(logits, 1 + j)[:, : windows.shape[1] - 1 - j], -1)
        ent = -(p * p.clamp_min(1e-30).log()).sum(-1).mean()  # full-vocab entropy (draft vocab = full here)
        kls.append(ce - ent)
    return sum(kls) / len(kls)


def test_loss_decreases_on_a_tiny_task(target_dir, greedy_data, tmp_path):
    cfg = TrainConfig(steps=30, **{**SMALL, "lr": 1e-2})
    res = train_drafter(target_dir, greedy_data, tmp_path / "d", cfg, log=lambda m: None)
    losses = [h["loss"] for h in res.history]
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    tm = ts.TargetModel.from_pretrained(target_dir, dtype=torch.float32)
    windows = token_windows(greedy_data, cfg.seq_len)
    fresh = build_drafter(tm, cfg, greedy_data)
    trained = ts.Eagle3Drafter.from_pretrained(res.out_dir)
    trained.attach_target_embedding(tm.embed)
    before, after = _mean_kl(fresh, tm, windows, 3), _mean_kl(trained, tm, windows, 3)
    assert after < 0.6 * before, (before, after)  # the learnable part of the loss shrinks a lot
    assert len(res.accuracies) == 3


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_export_reloads_and_runs_losslessly(target_dir, greedy_data, tmp_path, variant):
    flag = variant == "eagle3.1"
    cfg = TrainConfig(steps=4, fc_norm=flag, norm_output=flag, draft_vocab_size=128, save_dtype="float16", **SMALL)
    out = train_drafter(target_dir, greedy_data, tmp_path / variant, cfg, log=lambda m: None).out_dir
    raw = json.loads((out / "config.json").read_text())
    assert raw["fc_norm"] is flag and raw["norm_output"] is flag and raw["draft_vocab_size"] == 128
    d = ts.Eagle3Drafter.from_pretrained(out)
    assert d.config.fc_norm is flag and int(d.t2d.sum()) == 128
    spec_cfg = ts.SpecConfig(num_speculative_tokens=3, top_k=2, num_draft_tokens=6)
    rt = ts.SpeculativeRuntime.from_pretrained(target_dir, d, backend="torch", max_seq_len=96, spec=spec_cfg)
    prompt = greedy_data[0][:8]
    spec = rt.generate(prompt, max_new_tokens=12, stop_token_ids=[])
    plain = rt.generate(prompt, max_new_tokens=12, speculative=False, stop_token_ids=[])
    assert spec.token_ids == plain.token_ids


def test_draft_vocab_is_the_most_frequent_ids():
    used = draft_vocab_from_counts([[7, 7, 7, 3, 3, 9]], 12, 2)
    assert used.tolist() == [3, 7]
    with pytest.raises(ValueError, match="larger than the target vocabulary"):
        draft_vocab_from_counts([[1]], 12, 13)


def test_resume_continues_and_rejects_incompatible_checkpoint(target_dir, greedy_data, tmp_path):
    out = tmp_path / "d"
    cfg = TrainConfig(steps=10, **SMALL)
    logs: list[str] = []
    # simulate a stopped run: train 6 steps with a 10-step schedule, keeping the step-5 checkpoint
    stopped = TrainConfig(**{**cfg.__dict__, "steps": 6})
    train_drafter(target_dir, greedy_data, out, stopped, log=logs.append)
    assert not (out / "checkpoint.pt").exists()  # a finished run removes its checkpoint
    from tritonspec.training import trainer as tr

    tm = ts.TargetModel.from_pretrained(target_dir, dtype=torch.float32)
    seqs = load_token_sequences(greedy_data, None, tm.vocab_size)
    windows = tr.Windows.cut(seqs, cfg)
    d = tr.build_drafter(tm, cfg, seqs)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad])
    tr._save_checkpoint(out / tr.CHECKPOINT, tr.fingerprint(tm, cfg, windows), d, opt, 5, [])
    res = train_drafter(target_dir, greedy_data, out, cfg, log=logs.append)
    assert any("resumed" in m and "step 5" in m for m in logs)
    assert res.history[-1]["step"] == 10 and len(res.history) == 5
    tr._save_checkpoint(out / tr.CHECKPOINT, tr.fingerprint(tm, cfg, windows), d, opt, 5, [])
    other = TrainConfig(**{**cfg.__dict__, "ttt_depth": 2})
    with pytest.raises(ValueError, match="incompatible.*ttt_depth"):
        train_drafter(target_dir, greedy_data, out, other, log=lambda m: None)
    train_drafter(
        target_dir, greedy_data, out, TrainConfig(**{**other.__dict__, "steps": 1}), resume=False, log=lambda m: None
    )


def test_bad_input_is_a_clear_error(target_dir, tmp_path):
    quiet = dict(log=lambda m: None)
    cfg = TrainConfig(steps=1, **SMALL)
    with pytest.raises(ValueError, match="empty"):
        train_drafter(target_dir, [], tmp_path / "a", cfg, **quiet)
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match="fewer than 2 tokens"):
        train_drafter(target_dir, tmp_path / "blank.jsonl", tmp_path / "a", cfg, **quiet)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        train_drafter(target_dir, tmp_path / "bad.jsonl", tmp_path / "a", cfg, **quiet)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        train_drafter(target_dir, tmp_path / "latin1.txt", tmp_path / "a", cfg, **quiet)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        train_drafter(target_dir, [[1, 2, 999]], tmp_path / "a", cfg, **quiet)
    with pytest.raises(ValueError, match="larger than the target vocabulary"):
        train_drafter(target_dir, [[1, 2, 3]], tmp_path / "a", TrainConfig(draft_vocab_size=300, **SMALL), **quiet)
    other = tmp_path / "other_tok"  # a tokenizer with more tokens than the target's vocabulary
    other.mkdir()
    tok = byte_tokenizer(other)
    tok.add_tokens([f"<x{i}>" for i in range(5)])
    tok.save_pretrained(str(other))
    with pytest.raises(ValueError, match="does not match the target"):
        train_drafter(target_dir, ["hello"], tmp_path / "a", cfg, tokenizer=str(other), **quiet)


def test_train_cli(target_dir, greedy_data, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in greedy_data))
    out = tmp_path / "cli"
    assert (
        main(
            [
                "train",
                "--target",
                str(target_dir),
                "--data",
                str(data),
                "--out",
                str(out),
                "--steps",
                "2",
                "--seq-len",
                "24",
                "--batch-size",
                "2",
                "--ttt-depth",
                "2",
                "--variant",
                "eagle3",
            ]
        )
        == 0
    )
    assert "accuracy_per_depth" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["fc_norm"] is False
    mixed = tmp_path / "mixed.jsonl"  # the 36-token sequences and their 10-token heads
    mixed.write_text("".join(json.dumps({"input_ids": x}) + "\n" for s in greedy_data for x in (s, s[:10])))
    long_out = tmp_path / "cli-long"
    args = ["train", "--target", str(target_dir), "--data", str(mixed), "--out", str(long_out), "--steps", "4"]
    assert main(args + ["--seq-len", "8", "--batch-size", "2", "--long-seq-len", "64", "--long-every", "2"]) == 0
    train_cfg = json.loads((long_out / "training_args.json").read_text())["train_config"]
    assert (train_cfg["long_seq_len"], train_cfg["long_every"]) == (64, 2)
    assert main(args + ["--seq-len", "24", "--long-seq-len", "16"]) == 2
    assert "long_seq_len=16 must exceed seq_len=24" in capsys.readouterr().err
    assert (
        main(["train", "--target", str(target_dir), "--data", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    )
    assert "does not exist" in capsys.readouterr().err


def test_resume_after_a_stop_equals_an_uninterrupted_run(target_dir, greedy_data, tmp_path, monkeypatch):
    """A run stopped after its step-5 checkpoint and resumed ends with exactly the weights of an
    uninterrupted run (batches depend on the step only): a resume that skipped the drafter or the
    optimizer state would not."""
    from tritonspec.training import trainer as tr

    cfg = TrainConfig(steps=8, **SMALL)  # checkpoint_every=5
    whole = train_drafter(target_dir, greedy_data, tmp_path / "whole", cfg, log=lambda m: None)
    real, calls = tr.ttt_forward, []

    def stop_at_step_6(*a, **k):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt("stopped")
        return real(*a, **k)

    monkeypatch.setattr(tr, "ttt_forward", stop_at_step_6)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(target_dir, greedy_data, tmp_path / "resumed", cfg, log=lambda m: None)
    assert (tmp_path / "resumed" / tr.CHECKPOINT).exists()
    monkeypatch.setattr(tr, "ttt_forward", real)
    logs: list[str] = []
    res = train_drafter(target_dir, greedy_data, tmp_path / "resumed", cfg, log=logs.append)
    assert any("resumed" in m and "step 5" in m for m in logs) and len(res.history) == 8
    a = ts.Eagle3Drafter.from_pretrained(whole.out_dir).state_dict()
    b = ts.Eagle3Drafter.from_pretrained(res.out_dir).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _mixed_lengths() -> list[list[int]]:
    """20 short sequences (ids < 100) and 5 long ones (ids >= 200)."""
    g = torch.Generator().manual_seed(0)
    short = [torch.randint(0, 100, (10,), generator=g).tolist() for _ in range(20)]
    return short + [torch.randint(200, 256, (40,), generator=g).tolist() for _ in range(5)]


def test_long_windows_come_from_the_long_sequences_every_nth_step():
    """``long_seq_len``: sequences of >= long_seq_len // 2 tokens are cut into long windows, the rest
    into short ones; every ``long_every``-th step is a long one and each pool goes through its own
    epochs, so every short window is seen once an epoch. The inverse: long_seq_len=0 never goes long."""
    from tritonspec.training import trainer as tr

    seqs = _mixed_lengths()
    cfg = TrainConfig(batch_size=2, seq_len=16, long_seq_len=64, long_every=4)
    w = tr.Windows.cut(seqs, cfg)
    assert w.short.shape == (12, 16) and bool((w.short < 100).all())  # 200 short tokens
    assert w.long.shape == (3, 64) and bool((w.long >= 200).all())  # 200 long tokens
    shapes = [tuple(w.batch(s, cfg).shape) for s in range(12)]
    assert shapes == [(2, 16)] * 3 + [(1, 64)] + [(2, 16)] * 3 + [(1, 64)] + [(2, 16)] * 3 + [(1, 64)]
    short_steps = [s for s in range(8) if not w.is_long(s, cfg)]  # the first 6 short batches: one epoch
    seen = torch.cat([w.batch(s, cfg) for s in short_steps])
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, w.short.tolist()))
    longs = torch.cat([w.batch(s, cfg) for s in (3, 7, 11)])  # the first 3 long batches: one long epoch
    assert sorted(map(tuple, longs.tolist())) == sorted(map(tuple, w.long.tolist()))
    assert w.largest(cfg) == (2, 64) and "3 of 64 (1 step in 4, 1 a step)" in w.describe(cfg)
    flat = tr.Windows.cut(seqs, TrainConfig(batch_size=2, seq_len=16))
    assert flat.long is None and flat.short.shape == (25, 16)  # all 400 tokens, in short windows
    assert {tuple(flat.batch(s, cfg).shape) for s in range(12)} == {(2, 16)}
    with pytest.raises(ValueError, match="0 of 20 training sequences have more than 32 tokens.*--n-long"):
        tr.Windows.cut(seqs[:20], cfg)
    with pytest.raises(ValueError, match="5 of 5 training sequences .*add short records, raise long_seq_len"):
        tr.Windows.cut(seqs[20:], cfg)
    # exactly half a long window is short: only sequences longer than long_seq_len // 2 go long
    under = tr.Windows.cut(seqs, TrainConfig(batch_size=2, seq_len=16, long_seq_len=79))  # 40 > 39: long
    assert under.long.shape == (2, 79) and under.short.shape == (12, 16)
    with pytest.raises(ValueError, match="0 of 25 training sequences have more than 40 tokens"):
        tr.Windows.cut(seqs, TrainConfig(batch_size=2, seq_len=16, long_seq_len=80))


def test_long_window_settings_are_validated():
    with pytest.raises(ValueError, match="long_seq_len=16 must exceed seq_len=16"):
        TrainConfig(seq_len=16, long_seq_len=16)
    with pytest.raises(ValueError, match="long_every=1 must be >= 2"):
        TrainConfig(long_every=1)


def test_long_windows_train_and_a_checkpoint_keeps_their_settings(target_dir, tmp_path):
    """A run with long windows trains on both shapes (the target's cache holds the long ones) and
    its checkpoint refuses a resume with another ``long_every``."""
    from tritonspec.training import trainer as tr

    seqs = _mixed_lengths()
    cfg = TrainConfig(steps=8, **{**SMALL, "seq_len": 16}, long_seq_len=64, long_every=4)
    res = train_drafter(target_dir, seqs, tmp_path / "d", cfg, log=lambda m: None)
    assert len(res.history) == 8 and all(math.isfinite(h["loss"]) for h in res.history)
    tm = ts.TargetModel.from_pretrained(target_dir, dtype=torch.float32)
    d = tr.build_drafter(tm, cfg, seqs)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad])
    fp = tr.fingerprint(tm, cfg, tr.Windows.cut(seqs, cfg))
    tr._save_checkpoint(tmp_path / "d" / tr.CHECKPOINT, fp, d, opt, 5, [])
    with pytest.raises(ValueError, match="incompatible.*long_every"):
        train_drafter(target_dir, seqs, tmp_path / "d", TrainConfig(**{**cfg.__dict__, "long_every": 3}))


def test_self_distillation_uses_the_loaded_target(target_dir, greedy_data, tmp_path, monkeypatch):
    """``regenerate_new_tokens`` replaces the data by the target's own greedy continuations,
    generated by the target the trainer already holds (it is not loaded a second time), and a
    loaded transformers model works as the target too."""
    from transformers import AutoModelForCausalLM

    loads = []
    real = ts.TargetModel.from_pretrained
    monkeypatch.setattr(ts.TargetModel, "from_pretrained", lambda *a, **k: loads.append(1) or real(*a, **k))
    cfg = TrainConfig(steps=1, regenerate_new_tokens=5, regenerate_prompt_tokens=6, regenerate_samples=3, **SMALL)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir))
    train_drafter(model, greedy_data, tmp_path / "d", cfg, log=lambda m: None)
    assert len(loads) == 1
    rows = [json.loads(line) for line in (tmp_path / "d" / "regenerated.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(len(r["input_ids"]) == r["prompt_len"] + 5 for r in rows)
    rt = ts.SpeculativeRuntime.from_pretrained(target_dir, None, backend="torch", max_seq_len=64)
    for r in rows:  # the continuation is the target's greedy one
        prompt = r["input_ids"][: r["prompt_len"]]
        want = rt.generate([prompt], max_new_tokens=5, speculative=False, stop_token_ids=[]).token_ids[0]
        assert r["input_ids"][r["prompt_len"] :] == want


def test_drafters_trained_together_equal_drafters_trained_alone(target_dir, greedy_data, tmp_path):
    """One shared target forward per step changes nothing: each drafter's weights equal a solo run's."""
    quiet = dict(log=lambda m: None)
    c31 = TrainConfig(steps=4, **SMALL)
    c3 = TrainConfig(steps=4, **{**SMALL, "ttt_depth": 2}, fc_norm=False, norm_output=False)
    both = train_drafters(target_dir, greedy_data, [(tmp_path / "j31", c31), (tmp_path / "j3", c3)], **quiet)
    assert [r.steps for r in both] == [4, 4]
    for name, cfg in (("31", c31), ("3", c3)):
        train_drafter(target_dir, greedy_data, tmp_path / f"s{name}", cfg, **quiet)
        joint = ts.Eagle3Drafter.from_pretrained(tmp_path / f"j{name}").state_dict()
        solo = ts.Eagle3Drafter.from_pretrained(tmp_path / f"s{name}").state_dict()
        assert joint.keys() == solo.keys()
        assert all(torch.equal(joint[k], solo[k]) for k in joint), name
    # the inverse: a drafter trained on other data differs, so the equality above is not vacuous
    train_drafter(target_dir, greedy_data[::-1], tmp_path / "other", c31, **quiet)
    other = ts.Eagle3Drafter.from_pretrained(tmp_path / "other").state_dict()
    solo = ts.Eagle3Drafter.from_pretrained(tmp_path / "s31").state_dict()
    assert not all(torch.equal(other[k], solo[k]) for k in solo)


def test_drafters_trained_together_must_share_the_data_settings(target_dir, greedy_data, tmp_path):
    a = TrainConfig(steps=2, **SMALL)
    b = TrainConfig(steps=2, **{**SMALL, "seq_len": 16})
    with pytest.raises(ValueError, match="must share seq_len"):
        train_drafters(target_dir, greedy_data, [(tmp_path / "a", a), (tmp_path / "b", b)], log=lambda m: None)
    with pytest.raises(ValueError, match="runs is empty"):
        train_drafters(target_dir, greedy_data, [], log=lambda m: None)


def test_time_budget_cuts_the_step_count(target_dir, greedy_data, tmp_path):
    logs: list[str] = []
    res = train_drafter(
        target_dir, greedy_data, tmp_path / "d", TrainConfig(steps=500, **SMALL), time_budget_s=0.0, log=logs.append
    )
    assert res.steps == 3 and len(res.history) == 3  # the probe steps, then the budget is spent
    assert any("time budget fits 3 steps (of 500)" in m for m in logs)
    args = json.loads((tmp_path / "d" / "training_args.json").read_text())
    assert args["steps_run"] == 3 and len(args["history"]) == 3


def test_warm_start_begins_from_the_given_drafter(target_dir, greedy_data, tmp_path):
    """init_from: the run starts from that drafter's weights and draft vocabulary (not a fresh
    init, not this data's vocabulary), continues to learn, and refuses a drafter of another variant."""
    cfg = TrainConfig(steps=6, draft_vocab_size=64, **SMALL)
    first = train_drafter(target_dir, greedy_data, tmp_path / "a", cfg, log=lambda m: None).out_dir
    src = ts.Eagle3Drafter.from_pretrained(first)
    tm = ts.TargetModel.from_pretrained(target_dir, dtype=torch.float32)
    other_data = [[200 + i % 50 for i in range(60)]]  # another vocabulary by frequency
    warm = build_drafter(tm, TrainConfig(init_from=str(first), draft_vocab_size=64, **SMALL), other_data)
    cold = build_drafter(tm, TrainConfig(draft_vocab_size=64, **SMALL), other_data)
    for k, v in src.state_dict().items():
        assert torch.equal(warm.state_dict()[k], v.float() if v.is_floating_point() else v), k
    assert not torch.equal(cold.d2t, src.d2t)  # inverse: the vocabulary really came from init_from
    assert not torch.equal(cold.fc.weight, src.fc.weight)
    res = train_drafter(
        target_dir,
        greedy_data,
        tmp_path / "b",
        TrainConfig(steps=6, init_from=str(first), draft_vocab_size=64, **SMALL),
        log=lambda m: None,
    )
    # same data and seed, so step 0 sees the first run's first batch: the loaded weights do better on it
    assert res.history[0]["loss"] < first_loss(first)
    with pytest.raises(ValueError, match="fc_norm"):
        build_drafter(
            tm, TrainConfig(init_from=str(first), draft_vocab_size=64, **{**SMALL, "fc_norm": False}), greedy_data
        )
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_drafter(tm, TrainConfig(init_from=str(first), draft_vocab_size=32, **SMALL), greedy_data)
    with pytest.raises(ValueError, match="cannot load a drafter"):
        build_drafter(tm, TrainConfig(init_from=str(tmp_path / "nope"), draft_vocab_size=64, **SMALL), greedy_data)


def test_warm_start_with_a_new_draft_vocabulary_carries_the_shared_rows(target_dir, greedy_data, tmp_path):
    """draft_vocab_file with init_from: the file's ids become the vocabulary (even of another size);
    the lm_head rows of ids both vocabularies hold come from the warm drafter, the others from the
    target's lm_head; every other weight is the warm drafter's. Bad files are refused by name."""
    from tritonspec.kernels.cpu_linear import unpack

    first = train_drafter(
        target_dir, greedy_data, tmp_path / "a", TrainConfig(steps=4, draft_vocab_size=64, **SMALL), log=lambda m: None
    ).out_dir
    src = ts.Eagle3Drafter.from_pretrained(first)
    tm = ts.TargetModel.from_pretrained(target_dir, dtype=torch.float32)
    old = src.target_ids().tolist()
    new = sorted(old[::2] + [i for i in range(tm.vocab_size) if i not in set(old)][:48])  # 32 kept, 48 new
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps(new[::-1]))  # any order
    d = build_drafter(
        tm, TrainConfig(init_from=str(first), draft_vocab_size=80, draft_vocab_file=str(vocab), **SMALL), []
    )
    assert d.target_ids().tolist() == new and int(d.t2d.sum()) == 80
    head = unpack(tm.lm_head).float()
    for j, t in enumerate(new):
        want = src.lm_head.weight[old.index(t)].float() if t in old else head[t]
        assert torch.equal(d.lm_head.weight[j], want), (j, t)
    assert sum(t in old for t in new) == 32  # the inverse: both kinds of row were checked
    for k, v in src.state_dict().items():
        if k not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(d.state_dict()[k], v.float()), k
    # a fresh drafter takes the file's vocabulary too, rows from the target
    cold = build_drafter(tm, TrainConfig(draft_vocab_size=80, draft_vocab_file=str(vocab), **SMALL), greedy_data)
    assert cold.target_ids().tolist() == new and torch.equal(cold.lm_head.weight, head[new])
    res = train_drafter(
        target_dir,
        greedy_data,
        tmp_path / "b",
        TrainConfig(steps=3, init_from=str(first), draft_vocab_size=80, draft_vocab_file=str(vocab), **SMALL),
        log=lambda m: None,
    )
    assert ts.Eagle3Drafter.from_pretrained(res.out_dir).target_ids().tolist() == new
    data = tmp_path / "d.jsonl"  # the same from the CLI
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in greedy_data))
    argv = ["train", "--target", str(target_dir), "--data", str(data), "--out", str(tmp_path / "cli"), "--steps", "2"]
    argv += ["--seq-len", "24", "--batch-size", "2", "--ttt-depth", "2", "--draft-vocab-size", "80"]
    assert main([*argv, "--draft-vocab-file", str(vocab), "--init-from", str(first)]) == 0
    cli = ts.Eagle3Drafter.from_pretrained(tmp_path / "cli")
    assert cli.target_ids().tolist() == new
    args = json.loads((tmp_path / "cli" / "training_args.json").read_text())["train_config"]
    assert args["init_from"] == str(first) and args["draft_vocab_file"] == str(vocab)
    # a resumed run must have the same ids: the file's content is in the checkpoint fingerprint
    from tritonspec.training import trainer as tr

    windows = tr.Windows.cut(greedy_data, TrainConfig(draft_vocab_size=80, **SMALL))
    cfg = TrainConfig(draft_vocab_size=80, draft_vocab_file=str(vocab), **SMALL)
    fp = tr.fingerprint(tm, cfg, windows)
    assert fp == tr.fingerprint(tm, cfg, windows) and "draft_vocab" in fp
    vocab.write_text(json.dumps(new, indent=2))  # the same ids laid out otherwise: the same run
    assert tr.fingerprint(tm, cfg, windows) == fp
    out = tmp_path / "resumed"
    out.mkdir()
    tr._save_checkpoint(out / tr.CHECKPOINT, fp, d, torch.optim.AdamW(d.parameters()), 1, [])
    vocab.write_text(json.dumps(new[1:] + [new[0] - 1 if new[0] else max(new) + 1]))
    assert tr.fingerprint(tm, cfg, windows) != fp
    only_vocab = r"incompatible with this run \(the draft vocabulary \(draft_vocab_file's ids\) differs\)"
    with pytest.raises(ValueError, match=only_vocab):
        train_drafter(target_dir, greedy_data, out, TrainConfig(**{**cfg.__dict__, "steps": 2}), log=lambda m: None)
    assert "draft_vocab" not in tr.fingerprint(tm, TrainConfig(draft_vocab_size=80, **SMALL), windows)  # as before
    for text, match in (
        ("[1, 2]", "draft_vocab_size=80 needs that many distinct ids"),
        (json.dumps([1] * 80), "holds 1 distinct ids in 80 entries"),
        (json.dumps(list(range(79)) + [10**6]), "outside the target vocabulary"),
        ('{"ids": 1}', "must hold a JSON list of integer"),
        ("not json", "cannot read a JSON list"),
    ):
        vocab.write_text(text)
        with pytest.raises(ValueError, match=match):
            build_drafter(tm, TrainConfig(draft_vocab_size=80, draft_vocab_file=str(vocab), **SMALL), greedy_data)
    with pytest.raises(ValueError, match="needs draft_vocab_size"):
        TrainConfig(draft_vocab_file=str(vocab))


def first_loss(out_dir) -> float:
    hist = json.loads((out_dir / "training_args.json").read_text())["history"]
    return hist[0]["loss"]


def test_autocast_bfloat16_trains_with_float32_weights(target_dir, greedy_data, tmp_path):
    """``autocast="bfloat16"``: the forwards run with bfloat16 matmuls, so the same seeded run ends at
    other weights than float32's (the inverse: autocast ignored would give identical ones); the loss
    still falls, the weights stay float32; anything else is refused by name."""
    quiet = dict(log=lambda m: None)
    runs = {}
    for ac in (None, "bfloat16"):
        cfg = TrainConfig(steps=30, autocast=ac, **{**SMALL, "lr": 1e-2})
        res = train_drafter(target_dir, greedy_data, tmp_path / str(ac), cfg, **quiet)
        losses = [h["loss"] for h in res.history]
        assert all(torch.isfinite(torch.tensor(losses))) and sum(losses[-5:]) < sum(losses[:5]), (ac, losses)
        runs[ac] = ts.Eagle3Drafter.from_pretrained(res.out_dir).fc.weight
    assert runs["bfloat16"].dtype == torch.float32
    assert not torch.equal(runs[None], runs["bfloat16"])
    with pytest.raises(ValueError, match="autocast='float8'"):
        TrainConfig(autocast="float8")
