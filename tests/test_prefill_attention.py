"""Prefill attention (causal SDPA over the new K/V) equals tree attention with an empty prefix and
a causal mask, for the valid (left-aligned) queries of ragged rows; whole-model prefill with and
without it agrees; an inverse test shows the comparison sees a wrong mask."""

from __future__ import annotations

import pytest
import torch

from tritonspec.kernels.kv_write import kv_write_reference
from tritonspec.kernels.prefill_attention import prefill_attention
from tritonspec.kernels.tree_attention import tree_attention_reference
from tritonspec.runtime.metadata import AttentionMetadata, KVCache
from tritonspec.runtime.target import TargetModel

from _util import random_prompts, tiny_target


def _case(B, P, hq, hkv, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, P, hq, D, generator=g)
    k = torch.randn(B, P, hkv, D, generator=g)
    v = torch.randn(B, P, hkv, D, generator=g)
    lens = torch.randint(1, P + 1, (B,), generator=g)
    return q, k, v, lens


def _tree_path(q, k, v, lens, mask):
    B, P, hkv, D = k.shape
    kc, vc = torch.zeros(B, P + 1, hkv, D), torch.zeros(B, P + 1, hkv, D)
    slots = torch.where(torch.arange(P)[None] < lens[:, None], torch.arange(P)[None], -1)
    kv_write_reference(kc, vc, slots, k, v)
    return tree_attention_reference(q, kc, vc, torch.zeros(B, dtype=torch.int64), mask, D**-0.5, P)


@pytest.mark.parametrize("B,P,hq,hkv,D", [(1, 1, 2, 2, 8), (3, 7, 4, 2, 16), (2, 99, 6, 3, 8)])
def test_prefill_attention_equals_causal_tree_attention(B, P, hq, hkv, D):
    q, k, v, lens = _case(B, P, hq, hkv, D, seed=P)
    causal = torch.ones(P, P, dtype=torch.bool).tril().expand(B, P, P)
    got = prefill_attention(q, k, v, D**-0.5)
    want = _tree_path(q, k, v, lens, causal)
    for b in range(B):
        n = int(lens[b])
        torch.testing.assert_close(got[b, :n], want[b, :n], atol=2e-6, rtol=1e-5)


def test_comparison_sees_a_wrong_mask():  # inverse: a full (non-causal) mask is detected
    q, k, v, lens = _case(2, 9, 4, 2, 8, seed=1)
    lens = torch.tensor([9, 9])
    full = torch.ones(2, 9, 9, dtype=torch.bool)
    assert not torch.allclose(prefill_attention(q, k, v, 8**-0.5), _tree_path(q, k, v, lens, full), atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_target_prefill_flag_gives_the_same_forward(arch):
    from tritonspec.runtime.ops import TorchOps

    model = tiny_target(arch, seed=3, vocab_size=97)
    tm = TargetModel.from_pretrained(model)
    tm.set_aux_layer_ids((1, 2))
    prompts = random_prompts(97, [5, 12, 1], seed=2)
    B, P = len(prompts), 12
    tokens = torch.zeros(B, P, dtype=torch.int64)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts])
    pos = torch.arange(P).expand(B, P)
    slots = torch.where(pos < lens[:, None], pos, -1)
    causal = torch.ones(P, P, dtype=torch.bool).tril().expand(B, P, P)
    zero = torch.zeros(B, dtype=torch.int64)
    outs = []
    for prefill in (False, True):
        tm.allocate_cache(B, P + 4)
        tm.k_cache.zero_()
        tm.v_cache.zero_()
        h, aux = tm.forward(TorchOps(), tokens, AttentionMetadata(pos, slots, zero, causal, P, prefill=prefill))
        outs.append((h, aux, tm.k_cache.clone()))
    (h0, a0, k0), (h1, a1, k1) = outs
    for b in range(B):
        n = int(lens[b])
        torch.testing.assert_close(h1[b, :n], h0[b, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a1[b, :n], a0[b, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k1[:, b, :n], k0[:, b, :n], atol=1e-5, rtol=1e-5)  # the cache, as written
    assert torch.equal(k1[0, :, :P], k0[0, :, :P])  # layer 0's K comes from the embeddings: bit for bit


@pytest.mark.parametrize("norm_output", [False, True])
def test_drafter_prefill_flag_gives_the_same_step(norm_output):
    """The drafter's prefill catch-up (``step(prefill=True)``) equals the tree-mask step on ragged
    rows; a drafter that attends only to itself would hide a wrong mask, so this one is random."""
    import tritonspec as ts
    from tritonspec.runtime.ops import TorchOps

    model = tiny_target("llama", seed=3, vocab_size=97)
    d = ts.Eagle3Drafter.for_target(model.config, seed=5, norm_output=norm_output)
    tm = TargetModel.from_pretrained(model)
    d.attach_target_embedding(tm.embed, {"max_position_embeddings": tm.max_position_embeddings})
    c = d.config
    B, P = 3, 11
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, P, c.hidden_size, generator=g)
    tokens = torch.randint(0, 97, (B, P), generator=g)
    lens = torch.tensor([11, 4, 1])
    pos = torch.arange(P).expand(B, P)
    slots = torch.where(pos < lens[:, None], pos, -1)
    causal = torch.ones(P, P, dtype=torch.bool).tril().expand(B, P, P)
    zero = torch.zeros(B, dtype=torch.int64)
    outs = []
    with torch.no_grad():
        for prefill in (False, True):
            kc = torch.zeros(B, P + 1, c.num_key_value_heads, c.head_dim)
            vc = torch.zeros_like(kc)
            outs.append(
                d.step(
                    TorchOps(),
                    hidden,
                    tokens,
                    AttentionMetadata(pos, slots, zero, causal, P, prefill=prefill),
                    KVCache(kc, vc),
                )
            )
    (h0, c0), (h1, c1) = outs
    for b in range(B):
        n = int(lens[b])
        torch.testing.assert_close(h1[b, :n], h0[b, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c1[b, :n], c0[b, :n], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(h0[0, 1:], h0[0, :1].expand(P - 1, -1), atol=1e-3)  # positions differ: not vacuous
