"""RMSNorm (and fused residual): reference vs Triton, plus the device-to-device copy baseline
that the GB/s figures are read against. Llama-3-8B shapes on a GPU (H 4096, bf16; 1 decode
row, 60 tree tokens, 8 x 60), small shapes on a CPU."""

from __future__ import annotations

import pytest
import torch

from tritonspec.kernels.rms_norm import rms_norm, rms_norm_reference

from conftest import CUDA, DEVICE, PROVIDERS, kernel_bench, nbytes, timed_fn  # noqa: F401

DTYPE = torch.bfloat16 if CUDA else torch.float32
HIDDEN = 4096 if CUDA else 256
ROWS = [1, 60, 480] if CUDA else [1, 60]


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_rms_norm(kernel_bench, provider, rows, residual):
    fn = timed_fn(provider, rms_norm, rms_norm_reference)
    x = torch.randn(rows, HIDDEN, device=DEVICE, dtype=DTYPE)
    r = torch.randn_like(x) if residual else None
    w = torch.randn(HIDDEN, device=DEVICE, dtype=DTYPE)
    moved = nbytes(x, w, x) + (2 * nbytes(x) if residual else 0)  # x, w in; y out (+ r in, s out)
    kernel_bench(
        lambda: fn(x, w, 1e-5, r),
        moved,
        provider=provider,
        rows=rows,
        hidden=HIDDEN,
        residual=residual,
        dtype=str(DTYPE),
    )


@pytest.mark.parametrize("mib", [1, 64] if CUDA else [1])
def test_device_copy_baseline(kernel_bench, mib):
    """``dst.copy_(src)`` within the device: the achievable-bandwidth yardstick (read + write)."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    kernel_bench(lambda: dst.copy_(src), 2 * src.numel(), provider="copy", mib=mib)
