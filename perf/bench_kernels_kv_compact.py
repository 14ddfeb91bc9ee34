"""KV compaction of the accepted path over all layers: reference vs Triton.
GPU: Llama-3-8B cache (32 layers, 8 KV heads x 128, bf16), batch 8, 7-slot paths; CPU: small."""

from __future__ import annotations

import pytest
import torch

from tritonspec.kernels.kv_compact import kv_compact, kv_compact_reference

from conftest import CUDA, DEVICE, PROVIDERS, kernel_bench, timed_fn  # noqa: F401

DTYPE = torch.bfloat16 if CUDA else torch.float32
L, HKV, D = (32, 8, 128) if CUDA else (4, 2, 64)
S = 4096 if CUDA else 256
M = 7


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_kv_compact(kernel_bench, provider, batch):
    fn = timed_fn(provider, kv_compact, kv_compact_reference)
    k = torch.randn(L, batch, S, HKV, D, device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    start = torch.full((batch,), 1000 if CUDA else 100, dtype=torch.int64, device=DEVICE)
    nodes = torch.tensor([[0, 2, 5, 9, 14, 20, 27]] * batch, device=DEVICE)  # every entry moves
    moved = 2 * 2 * L * batch * (M - 1) * HKV * D * k.element_size()  # K and V, read + write
    kernel_bench(
        lambda: fn(k, v, start, nodes), moved, provider=provider, batch=batch, layers=L, path=M, dtype=str(DTYPE)
    )
