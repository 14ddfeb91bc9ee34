"""Aux-state gather with fused fc_norm: reference vs Triton. Llama-3-8B on a GPU (3 captured
states of H 4096, bf16; 8 rows of accepted tokens and a 480-row catch-up), small on a CPU."""

from __future__ import annotations

import pytest
import torch

from tritonspec.kernels.aux_gather import aux_gather, aux_gather_reference

from conftest import CUDA, DEVICE, PROVIDERS, kernel_bench, nbytes, timed_fn  # noqa: F401

DTYPE = torch.bfloat16 if CUDA else torch.float32
HIDDEN = 4096 if CUDA else 256
N_AUX = 3


@pytest.mark.parametrize("fc_norm", [True, False])
@pytest.mark.parametrize("n", [8, 480] if CUDA else [8, 60])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_aux_gather(kernel_bench, provider, n, fc_norm):
    fn = timed_fn(provider, aux_gather, aux_gather_reference)
    aux = torch.randn(2 * n, N_AUX * HIDDEN, device=DEVICE, dtype=DTYPE)
    index = torch.randperm(2 * n, device=DEVICE)[:n]
    index[::7] = -1
    w = torch.randn(N_AUX, HIDDEN, device=DEVICE, dtype=DTYPE) if fc_norm else None
    row = aux[0]
    moved = 2 * n * nbytes(row) + (nbytes(w) if fc_norm else 0)  # rows in + rows out (+ weights)
    kernel_bench(
        lambda: fn(aux, index, w, 1e-5),
        moved,
        provider=provider,
        n=n,
        hidden=HIDDEN,
        n_aux=N_AUX,
        fc_norm=fc_norm,
        dtype=str(DTYPE),
    )
