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


def timed_fn(provider: str, launcher, reference):
    """What a benchmark times for ``provider``: ``launcher`` (our Triton kernel) for ``"triton"``,
    skipping the test without CUDA or Triton; else ``reference`` (the ``<op>_reference`` the torch
    backend runs)."""
    if provider != "triton":
        return reference
    if not CUDA:
        pytest.skip(NO_GPU)
    pytest.importorskip("triton")
    return launcher


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
        if benchmark.stats is None:  # --benchmark-disable (CI): the call ran once, nothing was timed
            return
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


# ---------------------------------------------------------------------------------------------
# End-to-end suites (perf/bench_e2e.py): one Bench (all systems loaded once) per session.
def pytest_addoption(parser):
    parser.addoption(
        "--e2e-prompts",
        type=int,
        default=None,
        help="prompts per set for perf/bench_e2e.py (default 8; 1 with --benchmark-disable)",
    )
    parser.addoption(
        "--e2e-tokens",
        type=int,
        default=None,
        help="new tokens per prompt for perf/bench_e2e.py (default 64; 8 with --benchmark-disable)",
    )
    parser.addoption("--soak-calls", type=int, default=2000, help="calls made by perf/bench_soak.py (default 2000)")


@pytest.fixture(scope="session")
def e2e(request, tmp_path_factory):
    """``(bench, prompt_sets, pair_name, n_prompts, max_new_tokens)`` on the demo pair when it is
    built, else on the tiny random pair (so the suites keep working in CI)."""
    from tritonspec.runtime.bench import Bench

    quick = request.config.getoption("benchmark_disable", False)
    if quick:  # a correctness pass (CI): one thread avoids intra-op threads spinning on busy cores
        torch.set_num_threads(1)
    n = request.config.getoption("--e2e-prompts") or (1 if quick else 8)
    tokens = request.config.getoption("--e2e-tokens") or (8 if quick else 64)
    from tritonspec import demo

    if demo.available():
        target, d3 = demo.demo_pair("eagle3")
        _, d31 = demo.demo_pair("eagle3.1")
        sets = {name: [r["prompt"] for r in demo.prompt_set(name)] for name in demo.PROMPT_SETS}
        bench = Bench(target, {"eagle3": d3, "eagle3.1": d31}, demo.ROOT / "draft-lm")
        pair = "demo"
    else:
        from tritonspec.runtime.tiny import tiny_random_pair

        root = tmp_path_factory.mktemp("e2e")
        target, d31 = tiny_random_pair(root / "pair")
        _, d3 = tiny_random_pair(root / "pair3", fc_norm=False, norm_output=False)
        code = "def f(x):\n    return x + 1\n\n"
        sets = {"standard": [code * 2] * 8, "long": [code * 12] * 8, "perturbed": ["\t" + code] * 8}
        bench = Bench(target, {"eagle3": d3, "eagle3.1": d31}, None, max_seq_len=512)
        pair = "tiny-random (demo pair not built)"
    return bench, sets, pair, n, tokens
