"""Deterministic mode's attention (``kernels.det_attention``) beside the default mode's kernel and the
fixed-order PyTorch path it replaced on a GPU.

Providers: ``torch`` (the reference, PyTorch SDPA), ``triton`` (``det_tree_attention``: one program per
query and KV head over its canonical sequence), ``triton-default`` (``kernels.tree_attention``, the
default mode: queries share key tiles), ``chunked`` (``runtime.deterministic.chunked_attention``, the
GPU's deterministic attention until 2026-12-07, with the batch-invariant bmm on a GPU). Shapes as
``bench_kernels_tree_attention.py``: GPU Llama-3-8B heads (32/8, head_dim 128, bf16), a 60-token
random tree, prefix 2K / 8K / 32K, batch 1 and 8, and prompts of 2K and 8K tokens; CPU 8/2 heads,
head_dim 64, prefix and prompt 256 (the Triton rows skip without a GPU). The PyTorch path is timed up
to 8K (trees) and 2K (prompts), 5 calls a round, so that the file fits ``perf/gpu_check.py``'s 90 s.
GB/s counts the K/V bytes of the prefix and tree once per KV head: the det kernel reads the prefix
once per query, so its rate against this count says what that costs.
"""

from __future__ import annotations

import pytest
import torch
from bench_kernels_tree_attention import BATCHES, DTYPE, HKV, PREFIXES, D, _case, bench_tree_case

from tritonspec.kernels import det_attention as da
from tritonspec.kernels.tree_attention import tree_attention
from tritonspec.runtime import deterministic as det

from conftest import CUDA, NO_GPU, kernel_bench, nbytes  # noqa: F401

PROVIDERS = ["torch", "triton", "triton-default", "chunked"]
PROMPTS = [2048, 8192] if CUDA else [256]


def _chunked(q, k_cache, v_cache, prefix_lens, mask, scale, kv_len):
    lay = det.decode_layout(prefix_lens, mask, kv_len, need_tail=True)
    if CUDA:
        from tritonspec.kernels.batch_invariant_matmul import batch_invariant_matmul

        return det.chunked_attention(q, k_cache, v_cache, lay, scale, bmm=batch_invariant_matmul)
    return det.chunked_attention(q, k_cache, v_cache, lay, scale)


def _fn(provider: str):
    if provider == "torch":
        return da.det_attention_reference
    if provider == "chunked":
        return _chunked
    if not CUDA:
        pytest.skip(NO_GPU)
    pytest.importorskip("triton")
    return da.det_tree_attention if provider == "triton" else tree_attention


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_det_attention(kernel_bench, provider, batch, prefix):
    if provider == "chunked" and prefix > 8192:
        pytest.skip("the chunked PyTorch path materialises every score: timed up to 8K (the check's time budget)")
    # the PyTorch path runs ~10-50 ms a call at 8K on a GPU: 5 calls a round keep the file in gpu_check's 90 s
    bench_tree_case(kernel_bench, _fn(provider), provider, batch, prefix, inner=5 if provider == "chunked" else None)


@pytest.mark.parametrize("P", PROMPTS)
@pytest.mark.parametrize("provider", ["torch", "triton", "chunked"])
def test_det_causal_attention(kernel_bench, provider, P):
    """A prompt of ``P`` tokens (batch 1): deterministic mode's prefill attention (5 calls a round: a causal
    8K prompt's attention is milliseconds, not microseconds)."""
    q, k, v, _, _ = _case(1, P)
    q = torch.randn(1, P, q.shape[2], D, device=q.device).to(DTYPE)
    k, v = k[:, :P], v[:, :P]
    if provider == "torch":
        causal = torch.ones(P, P, dtype=torch.bool, device=q.device).tril()[None]
        zero = torch.zeros(1, dtype=torch.int64, device=q.device)
        fn = lambda: da.det_attention_reference(q, k, v, zero, causal, D**-0.5)  # noqa: E731
    elif provider == "chunked":
        lay = det.causal_layout(1, 0, P, q.device)
        fn = lambda: det.chunked_attention(q, k, v, lay, D**-0.5)  # noqa: E731
    else:
        if not CUDA:
            pytest.skip(NO_GPU)
        fn = lambda: da.det_causal_attention(q, k, v, D**-0.5)  # noqa: E731
    if provider == "chunked" and P > 2048:
        pytest.skip("the chunked PyTorch path materialises every score: timed up to 2K (the check's time budget)")
    moved = 2 * P * HKV * D * k.element_size() + 2 * nbytes(q)
    kernel_bench(fn, moved, inner=5, provider=provider, prompt=P, dtype=str(DTYPE))
