"""Tree attention (and the KV write before it): reference vs Triton.

GPU: Llama-3-8B (32 query / 8 KV heads, head_dim 128, bf16), 60 tree tokens under a random
tree mask, prefix 2K / 8K / 32K, batch 1 and 8. CPU: 8/2 heads, head_dim 64, prefix 256.
GB/s counts the K/V bytes a query block must read (prefix + tree, once per KV head) plus q and
the output.
"""

from __future__ import annotations

import pytest
import torch

from tritonspec.kernels.kv_write import kv_write, kv_write_reference
from tritonspec.kernels.tree_attention import tree_attention, tree_attention_reference

from conftest import CUDA, DEVICE, PROVIDERS, kernel_bench, nbytes, timed_fn  # noqa: F401

DTYPE = torch.bfloat16 if CUDA else torch.float32
HQ, HKV, D = (32, 8, 128) if CUDA else (8, 2, 64)
T = 60 if CUDA else 16
PREFIXES = [2048, 8192, 32768] if CUDA else [256]
BATCHES = [1, 8] if CUDA else [1, 2]


def _tree_mask(batch, t, g):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, t)]
    m = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m[None].expand(batch, t, t).contiguous()


def _case(batch, prefix):
    g = torch.Generator().manual_seed(0)
    S = prefix + T + 1
    q = torch.randn(batch, T, HQ, D, generator=g).to(DTYPE).to(DEVICE)
    k_cache = torch.randn(batch, S, HKV, D, generator=g).to(DTYPE).to(DEVICE)
    v_cache = torch.randn(batch, S, HKV, D, generator=g).to(DTYPE).to(DEVICE)
    prefix_lens = torch.full((batch,), prefix, dtype=torch.int64, device=DEVICE)
    return q, k_cache, v_cache, prefix_lens, _tree_mask(batch, T, g).to(DEVICE)


def bench_tree_case(kernel_bench, fn, provider: str, batch: int, prefix: int, inner: int | None = None) -> None:
    """Time ``fn(q, k_cache, v_cache, prefix_lens, mask, scale, kv_len)`` on ``_case(batch, prefix)``
    (also ``bench_kernels_det_attention.py``'s): GB/s over the prefix and tree K/V, q twice and the mask;
    ``inner``: calls per timed round (``kernel_bench``'s default when None)."""
    q, k_cache, v_cache, prefix_lens, mask = _case(batch, prefix)
    kv_len = prefix + T
    moved = 2 * batch * kv_len * HKV * D * k_cache.element_size() + 2 * nbytes(q) + nbytes(mask)
    kernel_bench(
        lambda: fn(q, k_cache, v_cache, prefix_lens, mask, D**-0.5, kv_len),
        moved,
        inner=inner,
        provider=provider,
        batch=batch,
        prefix=prefix,
        tree_tokens=T,
        heads=f"{HQ}/{HKV}",
        head_dim=D,
        dtype=str(DTYPE),
    )


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_tree_attention(kernel_bench, provider, batch, prefix):
    bench_tree_case(kernel_bench, timed_fn(provider, tree_attention, tree_attention_reference), provider, batch, prefix)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_kv_write(kernel_bench, provider, batch):
    fn = timed_fn(provider, kv_write, kv_write_reference)
    S = 4096 if CUDA else 512
    k_cache = torch.zeros(batch, S, HKV, D, device=DEVICE, dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    slots = (torch.arange(T, device=DEVICE) + 100).expand(batch, T).contiguous()
    k = torch.randn(batch, T, HKV, D, device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    kernel_bench(
        lambda: fn(k_cache, v_cache, slots, k, v),
        4 * nbytes(k),
        provider=provider,
        batch=batch,
        tokens=T,
        dtype=str(DTYPE),
    )
