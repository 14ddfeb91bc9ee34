"""Batch-invariant matmul (deterministic mode's linear layers on a GPU) against cuBLAS: what the
mode costs per projection. Llama-3-8B projections in bf16 on a GPU (q/o 4096x4096, k/v
1024x4096, gate/up 14336x4096, down 4096x14336, lm_head 128256x4096) at 1 decode row, 60 tree
tokens and 4 x 60; small shapes on a CPU.

Providers: ``cublas`` (``F.linear``, what the default mode runs), ``triton``
(``batch_invariant_linear``, the shipped tiling), ``triton-<tiling>`` (the same kernel with the
alternative tilings of ``BENCH_TILINGS``), ``triton-k<chunk>`` (the shipped tiling with K in
fixed chunks, ``BENCH_K_SPLITS``: more programs for a few rows, e.g. 7 x 64 for the down
projection) and ``torch`` (``batch_invariant_matmul_reference``: fp32 PyTorch, the correctness
yardstick, slow by design). GB/s counts the weight, the input and the output once.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tritonspec.kernels.batch_invariant_matmul import (
    BENCH_K_SPLITS,
    BENCH_TILINGS,
    batch_invariant_linear,
    batch_invariant_matmul_reference,
)

from conftest import CUDA, DEVICE, PROVIDERS, kernel_bench, nbytes, timed_fn  # noqa: F401

DTYPE = torch.bfloat16 if CUDA else torch.float32
SHAPES = (
    {"qo": (4096, 4096), "kv": (1024, 4096), "gate_up": (14336, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)}
    if CUDA
    else {"qo": (256, 256)}
)
ROWS = [1, 60, 240] if CUDA else [1, 8]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("proj", sorted(SHAPES))
@pytest.mark.parametrize(
    "provider",
    [*PROVIDERS, "cublas", *(f"triton-{t}" for t in BENCH_TILINGS), *(f"triton-k{k}" for k in BENCH_K_SPLITS)],
)
def test_batch_invariant_linear(kernel_bench, provider, proj, rows):
    if provider == "torch" and CUDA:
        pytest.skip("on a GPU the fp32 reference is a correctness yardstick, not timed (cublas is the baseline)")
    n, k = SHAPES[proj]
    if provider == "cublas":
        fn = F.linear
    elif provider.startswith("triton-k"):  # the shipped tiling, K in fixed chunks (``k_split``)
        if CUDA and (rows > 60 or proj in ("gate_up", "lm_head")):
            pytest.skip("a K split pays where a few rows of a narrow output give few programs: not timed here")
        fn = timed_fn("triton", functools.partial(batch_invariant_linear, k_split=int(provider[8:])), None)
    elif provider.startswith("triton-"):
        tiling = BENCH_TILINGS[provider.removeprefix("triton-")]  # alternative fixed tilings (the kernel module)
        fn = timed_fn("triton", functools.partial(batch_invariant_linear, config=tiling), None)
    else:
        fn = timed_fn(provider, batch_invariant_linear, lambda x, w: batch_invariant_matmul_reference(x, w.t()))
    x = torch.randn(rows, k, device=DEVICE, dtype=DTYPE)
    w = torch.randn(n, k, device=DEVICE, dtype=DTYPE) * 0.02
    kernel_bench(
        lambda: fn(x, w),
        nbytes(w, x) + rows * n * x.element_size(),  # the weight and x read, the output written
        inner=20,
        provider=provider,
        proj=proj,
        n=n,
        k=k,
        rows=rows,
        dtype=str(DTYPE),
    )
