"""Sampling tree verification: reference vs Triton.

GPU: Llama-3-8B's vocabulary (128256), 60 tree tokens, depth 6, batch 1 / 8 / 64. CPU: vocabulary
4096, 48 tree tokens, batch 1 / 8. The target rows put half their mass on one child's token, so
paths are accepted to a few levels (as with a good drafter) and the kernel makes its per-level
passes over V. GB/s counts the bytes the kernel must touch: per row, one fp32 pass over V per
visited node (the masses) plus the bonus pass (the final row, the noise, the marks), the marks'
memset, and the small per-node inputs; the number of visited nodes is the reference's.
"""

from __future__ import annotations

import pytest
import torch

from tritonspec.kernels.verify_sampling import verify_sampling, verify_sampling_reference

from conftest import CUDA, DEVICE, PROVIDERS, kernel_bench, nbytes, timed_fn  # noqa: F401

N = 60 if CUDA else 48
VOCAB = 128256 if CUDA else 4096
DEPTH = 6


def _case(batch: int):
    g = torch.Generator().manual_seed(0)
    parents = torch.tensor(
        [
            [-1] + [max(0, i - 1 - int(torch.randint(0, 3, (1,), generator=g))) for i in range(1, N)]
            for _ in range(batch)
        ]
    )
    tokens = torch.randint(0, VOCAB, (batch, N), generator=g)
    gd = torch.Generator(device=DEVICE).manual_seed(0)  # the big tensors are drawn on the device
    probs = torch.softmax(torch.randn(batch, N, VOCAB, generator=gd, device=DEVICE) * 2, -1) * 0.5
    first_child = [
        [next((k for k in range(i + 1, N) if parents[b, k] == i), -1) for i in range(N)] for b in range(batch)
    ]
    for b in range(batch):
        for i, k in enumerate(first_child[b]):
            if k >= 0:
                probs[b, i, tokens[b, k]] += 0.5
    u = torch.rand(batch, N, generator=gd, device=DEVICE)
    xi = torch.empty(batch, VOCAB, device=DEVICE).exponential_(generator=gd)
    return tokens.to(DEVICE), parents.to(DEVICE), probs, u, xi


@pytest.mark.parametrize("batch", [1, 8, 64] if CUDA else [1, 8])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_verify_sampling(kernel_bench, provider, batch):
    fn = timed_fn(provider, verify_sampling, verify_sampling_reference)
    tokens, parents, probs, u, xi = _case(batch)
    _, num, _ = verify_sampling_reference(tokens, parents, probs, u, xi, DEPTH)
    rows_read = int(num.sum()) + 2 * batch  # the root's and each accepted node's mass, the bonus row
    moved = (
        rows_read * VOCAB * 4
        + nbytes(xi)
        + 2 * batch * VOCAB
        + nbytes(tokens, parents, u)
        + 2 * batch * (DEPTH + 1) * 8
        + batch * 8
    )
    kernel_bench(
        lambda: fn(tokens, parents, probs, u, xi, DEPTH),
        moved,
        provider=provider,
        batch=batch,
        nodes=N,
        vocab=VOCAB,
        depth=DEPTH,
        mean_accepted=round(float(num.float().mean()), 2),
    )
