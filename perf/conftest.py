"""Shared pieces of the kernel benchmarks (``perf/bench_kernels_<op>.py``, pytest-benchmark).

Run: ``python -m pytest perf/bench_kernels_rms_norm.py --benchmark-only`` (any subset of the
files; pass them explicitly, their names are not ``test_*``). On a GPU every op is timed twice,
``provider=torch`` (the ``<op>_reference`` the torch backend runs) and ``provider=triton``
(our launcher); without CUDA the Triton rows skip (the interpreter is not a performance path)
and the reference runs at small shapes. Each benchmark reports in ``extra_info``:
``us_per_call`` (median) and ``gbps`` (bytes the op must move / time), plus the shape.
"""
from __future__ import annotations

import time

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
NO_GPU = "no GPU: Triton timings need CUDA (the interpreter is a correctness tool, not a performance path)"
PROVIDERS = ["torch", "triton"]


def skip_unless_runnable(provider: str) -> None:
    if provider == "triton":
        if not CUDA:
            pytest.skip(NO_GPU)
        pytest.importorskip("triton")


@pytest.fixture
def kernel_bench(benchmark):
    """``run(fn, nbytes, **info)``: time ``fn()``; on CUDA each round is ``inner`` back-to-back
    calls closed by one synchronize, so launch-bound kernels are not drowned in sync cost."""

    def run(fn, nbytes: int, inner: int | None = None, **info):
        inner = inner or (50 if CUDA else 3)
        fn()  # compile / warm caches outside the timing
        if CUDA:
            torch.cuda.synchronize()

        def many():
            for _ in range(inner):
                fn()
            if CUDA:
                torch.cuda.synchronize()

        rounds = 20 if CUDA else 5
        benchmark.pedantic(many, rounds=rounds, warmup_rounds=1, iterations=1)
        sec = benchmark.stats["median"] / inner
        benchmark.extra_info.update(info)
        benchmark.extra_info["device"] = torch.cuda.get_device_name() if CUDA else "cpu"
        benchmark.extra_info["us_per_call"] = round(sec * 1e6, 3)
        benchmark.extra_info["bytes"] = int(nbytes)
        benchmark.extra_info["gbps"] = round(nbytes / sec / 1e9, 4)
        benchmark.extra_info["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S")

    return run


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
