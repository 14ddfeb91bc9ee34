"""Greedy speculative output equals plain greedy output and transformers' greedy generate."""

from __future__ import annotations

import pytest
import torch

import tritonspec as ts

from _util import hf_greedy, perm_pair, random_prompts, runtime, tiny_target

SPECS = {"chain": ts.SpecConfig.chain(4), "tree": ts.SpecConfig(num_speculative_tokens=4, top_k=4, num_draft_tokens=16)}


def pair(arch, vocab, seed=1, **flags):
    model = tiny_target(arch, seed=seed, vocab_size=vocab)
    return model, ts.Eagle3Drafter.for_target(model.config, seed=seed + 1, **flags)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("batch", [1, 4])
def test_speculative_equals_plain_and_transformers(arch, shape, batch):
    """A deliberately good drafter (deep acceptances, KV compaction over many rounds)."""
    model, drafter = perm_pair(arch, vocab=24, seed=1, alpha=0.15)
    rt = runtime(model, drafter, SPECS[shape])
    prompts = random_prompts(24, [7, 1, 12, 4][:batch], seed=batch)
    spec = rt.generate(prompts, max_new_tokens=40)
    plain = rt.generate(prompts, max_new_tokens=40, speculative=False)
    assert spec.token_ids == plain.token_ids
    for p, got in zip(prompts, spec.token_ids):
        assert got == hf_greedy(model, p, 40)
    assert all(len(t) == 40 for t in spec.token_ids)
    s = spec.stats
    assert s.accepted_per_position[-1] > 0, "paths of full depth must be accepted"
    assert s.num_accepted_tokens <= s.num_drafts * SPECS[shape].num_speculative_tokens


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_random_drafter_partial_acceptance(shape):
    """A random drafter over a 16-token vocabulary: accepted only by chance, output unchanged."""
    model, drafter = pair("llama", vocab=16)
    rt = runtime(model, drafter, SPECS[shape])
    prompts = random_prompts(16, [7, 1, 12, 4], seed=4)
    spec = rt.generate(prompts, max_new_tokens=40)
    assert spec.token_ids == rt.generate(prompts, max_new_tokens=40, speculative=False).token_ids
    assert 0 < spec.stats.num_accepted_tokens < spec.stats.num_drafts


@pytest.mark.parametrize("flags", [dict(fc_norm=False, norm_output=False), dict(fc_norm=True, norm_output=True)])
def test_batch_rows_equal_their_solo_runs(flags):
    model, drafter = perm_pair("llama", vocab=24, seed=3, alpha=0.4, **flags)
    rt = runtime(model, drafter, ts.SpecConfig(num_speculative_tokens=3, top_k=3, num_draft_tokens=10))
    prompts = random_prompts(24, [3, 17, 8, 1, 11], seed=7)
    batch = rt.generate(prompts, max_new_tokens=30)
    for p, row in zip(prompts, batch.token_ids):
        assert rt.generate([p], max_new_tokens=30).token_ids[0] == row


def test_stats_identities():
    model, drafter = perm_pair("llama", vocab=16, alpha=0.4)
    rt = runtime(model, drafter, SPECS["tree"])
    out = rt.generate(random_prompts(16, [5, 9, 2], seed=2), max_new_tokens=33)
    s = out.stats
    assert s.num_drafts > 0
    assert s.mean_acceptance_length == pytest.approx(1 + s.num_accepted_tokens / s.num_drafts)
    assert sum(s.accepted_per_position) == s.num_accepted_tokens
    assert all(a >= b for a, b in zip(s.accepted_per_position, s.accepted_per_position[1:]))
    assert s.num_draft_tokens == s.num_drafts * (SPECS["tree"].num_draft_tokens - 1)
    # every round emits accepted + 1 tokens; the prefill emits one per row; the last round may be trimmed
    assert s.num_new_tokens == 3 * 33 <= 3 + s.num_drafts + s.num_accepted_tokens
    assert s.tokens_per_second > 0 and set(s.time_split_s) == {"prefill", "draft", "verify", "commit"}


def test_stop_tokens_and_max_new_tokens_are_exact_in_batch():
    model, drafter = perm_pair("llama", vocab=16, seed=5, alpha=0.4)
    rt = runtime(model, drafter, SPECS["tree"])
    prompts = random_prompts(16, [4, 6, 9, 2], seed=11)
    full = rt.generate(prompts, max_new_tokens=40, speculative=False).token_ids
    # a stop token that first appears at a different depth in each row
    stop = max(range(16), key=lambda t: len({row.index(t) for row in full if t in row}))
    out = rt.generate(prompts, max_new_tokens=40, stop_token_ids=[stop])
    for row, got, why in zip(full, out.token_ids, out.finish_reasons):
        want = row[: row.index(stop) + 1] if stop in row else row
        assert got == want and why == ("stop" if stop in row else "length")
    assert len({len(r) for r in out.token_ids}) > 1, "rows must stop at different rounds"
    for n in (1, 2, 7):
        assert [len(r) for r in rt.generate(prompts, max_new_tokens=n).token_ids] == [n] * 4


def test_max_seq_len_caps_prompt_plus_generation():
    model, drafter = pair("llama", vocab=16)
    rt = runtime(model, drafter, SPECS["tree"], max_seq_len=20)
    out = rt.generate(random_prompts(16, [5, 12], seed=3), max_new_tokens=100)
    assert [len(r) for r in out.token_ids] == [15, 8] and out.finish_reasons == ["length", "length"]


def test_bad_input_errors():
    model, drafter = pair("llama", vocab=16)
    rt = runtime(model, drafter, SPECS["chain"], max_seq_len=32, max_batch_size=2)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        rt.generate([[]])
    with pytest.raises(ValueError, match="prompt 0 has 40 tokens but max_seq_len=32"):
        rt.generate([[1] * 40])
    with pytest.raises(ValueError, match="max_new_tokens=0 must be >= 1"):
        rt.generate([[1, 2]], max_new_tokens=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rt.generate([[1, 99]])
    with pytest.raises(ValueError, match="need a tokenizer"):
        rt.generate("hello")
    with pytest.raises(ValueError, match="top_k=20 exceeds the drafter's draft_vocab_size=16"):
        runtime(model, drafter, ts.SpecConfig(2, 20, 10))
    with pytest.raises(ValueError, match="lower num_draft_tokens"):
        ts.SpecConfig(num_speculative_tokens=2, top_k=2, num_draft_tokens=8)


def near_tie_gaps(model, prompt, a, b):
    """For two greedy continuations that differ, the target's top-2 logit gap where they split."""
    i = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + a[:i]])).logits[0, -1].float()
    top2 = logits.topk(2).values
    return float(top2[0] - top2[1])


def test_divergences_sit_only_at_near_ties():
    """Verify (N-row forward) and decode (1-row forward) may round differently; divergence from plain
    greedy is allowed only where the target's top-2 logits are within 1e-4 (float32)."""
    gaps, rounds = [], 0
    for seed in range(4):
        model, drafter = perm_pair("llama", vocab=24, seed=20 + seed, alpha=0.4)
        rt = runtime(model, drafter, ts.SpecConfig(num_speculative_tokens=3, top_k=3, num_draft_tokens=10))
        prompts = random_prompts(24, [3, 5, 8, 13], seed=seed)
        spec = rt.generate(prompts, max_new_tokens=48)
        plain = rt.generate(prompts, max_new_tokens=48, speculative=False)
        rounds += spec.stats.num_drafts
        gaps += [near_tie_gaps(model, p, a, b) for p, a, b in zip(prompts, spec.token_ids, plain.token_ids) if a != b]
    assert rounds > 100
    assert all(g < 1e-4 for g in gaps), f"divergence away from a near-tie: gaps {gaps}"


def test_near_tie_checker_has_teeth():
    """Inverse test: a divergence forced at an ordinary position shows a large gap."""
    model = tiny_target("llama", seed=2, vocab_size=24)
    p = random_prompts(24, [6], seed=0)[0]
    a = hf_greedy(model, p, 10)
    b = a[:3] + [(a[3] + 1) % 24] + a[4:]
    assert near_tie_gaps(model, p, a, b) > 1e-2
