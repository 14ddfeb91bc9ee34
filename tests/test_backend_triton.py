"""``backend="triton"`` runs the whole runtime, and its output equals ``backend="torch"``.

Every hot-path op (RMSNorm, aux gather, KV write, tree attention, greedy and sampling
verification, KV compaction) runs as a Triton kernel; without CUDA under ``TRITON_INTERPRET=1``
(tests/conftest.py), which costs milliseconds per program, so the model is tiny (hidden 32, 2/1
heads, 3 layers, vocabulary 24) and the generations are short. The drafter is the deliberately
good one of ``perm_pair``: acceptance is partial, with full-depth paths accepted in some rounds,
so rejections, bonus tokens and KV compaction over overlapping ranges all occur.

Equality with the torch backend is token for token: the float kernels are within ULP bounds of
the references, not bit-identical, so a near-tie in the target's logits could in principle flip
a token; the seeds and prompts here are far from ties (the tests would say so), and the discrete
kernels (verification, compaction, gathers) are bit-exact. The whole file takes about two
minutes on two busy CPU cores; nothing is marked slow.
"""

from __future__ import annotations

import pytest
import torch

import tritonspec as ts

from _util import perm_pair, random_prompts, runtime

pytest.importorskip("triton")

SMALL = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=48, num_hidden_layers=3)
VOCAB = 24
SPECS = {"chain": ts.SpecConfig.chain(3), "tree": ts.SpecConfig(num_speculative_tokens=3, top_k=2, num_draft_tokens=6)}
PROMPT_LENS = [5, 1, 9]
NEW = 12
SEQ = 40
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU the kernels run compiled
RT = dict(max_seq_len=SEQ, device=DEVICE, dtype=torch.float32)


def _pair(**flags):
    return perm_pair("llama", vocab=VOCAB, seed=2, alpha=0.3, target_overrides=SMALL, **flags)


def _both(model, drafter, spec, prompts, **gen):
    """The same generation through both backends: ``(torch output, triton output)``."""
    outs = []
    for backend in ("torch", "triton"):
        rt = runtime(model, drafter, spec, backend=backend, **RT)
        assert rt.ops.name == backend
        outs.append(rt.generate(prompts, max_new_tokens=NEW, **gen))
    return outs


def _check_stats_equal(a, b):
    for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position"):
        assert getattr(a.stats, k) == getattr(b.stats, k), k


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_greedy_triton_equals_plain_greedy_and_torch(shape, batch):
    model, drafter = _pair()
    prompts = random_prompts(VOCAB, PROMPT_LENS[:batch], seed=batch)
    ref, tri = _both(model, drafter, SPECS[shape], prompts)
    plain = runtime(model, None, backend="torch", **RT).generate(prompts, max_new_tokens=NEW, speculative=False)
    assert tri.token_ids == plain.token_ids == ref.token_ids
    assert all(len(t) == NEW for t in tri.token_ids)
    _check_stats_equal(tri, ref)
    s = tri.stats
    assert 0 < s.num_accepted_tokens < s.num_drafts * SPECS[shape].num_speculative_tokens, "partial acceptance"
    assert s.accepted_per_position[-1] > 0, "paths of full depth must be accepted"


def test_plain_decoding_through_triton_equals_torch():
    """``speculative=False`` (one target forward per token) through the Triton kernels."""
    model, drafter = _pair()
    prompts = random_prompts(VOCAB, PROMPT_LENS, seed=5)
    ref, tri = _both(model, drafter, SPECS["tree"], prompts, speculative=False)
    assert tri.token_ids == ref.token_ids


@pytest.mark.parametrize("batch", [1, 3])
def test_sampling_with_seed_equals_torch(batch):
    """temperature > 0: the sampling verifier kernel, same seed, same tokens as the torch backend."""
    model, drafter = _pair()
    prompts = random_prompts(VOCAB, PROMPT_LENS[:batch], seed=7)
    seeds = [11, 12, 13][:batch]
    ref, tri = _both(model, drafter, SPECS["tree"], prompts, temperature=1.0, seed=seeds)
    assert tri.token_ids == ref.token_ids
    _check_stats_equal(tri, ref)
    assert tri.stats.num_accepted_tokens > 0
    assert tri.stats.num_accepted_tokens < tri.stats.num_drafts * SPECS["tree"].num_speculative_tokens


@pytest.mark.parametrize("fc_norm", [False, True])
def test_fc_norm_drafters(fc_norm):
    """EAGLE-3 (plain aux gather) and EAGLE-3.1 (fc_norm: the fused gather + per-state RMSNorm)."""
    model, drafter = _pair(fc_norm=fc_norm, norm_output=fc_norm)
    prompts = random_prompts(VOCAB, PROMPT_LENS[:1], seed=3)
    ref, tri = _both(model, drafter, SPECS["tree"], prompts)
    assert tri.token_ids == ref.token_ids
    _check_stats_equal(tri, ref)
    assert tri.stats.num_accepted_tokens > 0


def test_triton_backend_uses_every_kernel(monkeypatch):
    """Each op of the Triton backend is called during a greedy and a sampling generation (no
    silent fallback to the torch references)."""
    from tritonspec.kernels.triton_ops import TritonOps

    model, drafter = _pair(fc_norm=True, norm_output=True)
    rt = runtime(model, drafter, SPECS["chain"], backend="triton", **RT)
    called = set()
    kernels = (
        "rms_norm",
        "aux_gather",
        "kv_write",
        "tree_attention",
        "verify_greedy",
        "verify_sampling",
        "verify_chain",
        "kv_compact",
    )
    for name in kernels:
        fn = getattr(TritonOps, name)
        monkeypatch.setattr(rt.ops, name, lambda *a, _fn=fn, _n=name, **k: called.add(_n) or _fn(*a, **k))
    prompt = random_prompts(VOCAB, [4], seed=0)
    rt.generate(prompt, max_new_tokens=4)
    rt.generate(prompt, max_new_tokens=4, temperature=1.0, seed=0)  # a sampled chain: verify_chain
    rt.spec = SPECS["tree"]
    rt.generate(prompt, max_new_tokens=4, temperature=1.0, seed=0)  # a tree: verify_sampling
    assert called == set(kernels)
