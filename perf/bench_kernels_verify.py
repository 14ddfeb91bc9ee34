"""Greedy tree verification: reference vs Triton (default SpecConfig: depth 6, 48 draft tokens;
60 on a GPU as in the Llama-3-8B runs). Launch/latency bound: read ``us_per_call``."""

from __future__ import annotations

import pytest
import torch

from tritonspec.kernels.verify import verify_greedy, verify_greedy_reference

from conftest import CUDA, DEVICE, PROVIDERS, kernel_bench, nbytes, timed_fn  # noqa: F401

N = 60 if CUDA else 48
DEPTH = 6


@pytest.mark.parametrize("batch", [1, 8, 64] if CUDA else [1, 8])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_verify_greedy(kernel_bench, provider, batch):
    fn = timed_fn(provider, verify_greedy, verify_greedy_reference)
    g = torch.Generator().manual_seed(0)
    parents = torch.tensor(
        [
            [-1] + [max(0, i - 1 - int(torch.randint(0, 3, (1,), generator=g))) for i in range(1, N)]
            for _ in range(batch)
        ],
        device=DEVICE,
    )
    tokens = torch.randint(0, 4, (batch, N), generator=g).to(DEVICE)
    argmax = torch.randint(0, 4, (batch, N), generator=g).to(DEVICE)
    moved = nbytes(tokens, parents, argmax) + 2 * batch * (DEPTH + 1) * 8 + batch * 8
    kernel_bench(
        lambda: fn(tokens, parents, argmax, DEPTH), moved, provider=provider, batch=batch, nodes=N, depth=DEPTH
    )
