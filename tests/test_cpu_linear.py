"""The row-invariant CPU linear kernel (``kernels/cpu_linear.py``, issues 21 and 16): close to the
float32 reference, every row bit-identical whatever shares the call, fallbacks that say why."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonspec.kernels import cpu_linear as cl
from tritonspec.runtime.ops import TorchOps

WHY = {dt: cl.available(dt) for dt in (torch.float32, torch.bfloat16)}
needs = {
    dt: pytest.mark.skipif(WHY[dt] is not None, reason=f"CPU linear kernel unavailable for {dt}: {WHY[dt]}")
    for dt in WHY
}
DTYPES = [pytest.param(dt, marks=needs[dt], id=str(dt).split(".")[-1]) for dt in WHY]


def _violations(fn, x: torch.Tensor, seed: int = 0) -> int:
    """Rows of ``fn`` over random subsets of ``x`` that differ, bit for bit, from the same row in
    ``fn(x)``: 0 for a row-invariant ``fn``."""
    full = fn(x)
    g = torch.Generator().manual_seed(seed)
    bad = 0
    for m in (1, 2, 3, 4, 5, 7, 8, 16, x.shape[0]):
        idx = torch.randperm(x.shape[0], generator=g)[: min(m, x.shape[0])]
        bad += int((fn(x[idx]) != full[idx]).any(-1).sum())
    return bad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nk", [(1, 1), (7, 13), (99, 33), (64, 576), (5, 1000), (33, 32), (17, 47)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(dtype, nk, m, bias):
    n, k = nk
    g = torch.Generator().manual_seed(n * 1000 + k + m)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    y = cl.cpu_linear(x, w, b)
    ref = cl.cpu_linear_reference(x, w, b)
    assert y.dtype == dtype and y.shape == (m, n)
    if dtype == torch.float32:
        assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5 * k**0.5)
    else:  # the float32 sum is the reference's up to order; the bfloat16 rounding at most one step apart
        exact = F.linear(x.float(), w.float(), None if b is None else b.float())
        step = exact.abs().clamp_min(1e-30) * 2.0**-7
        assert ((y.float() - exact).abs() <= step + 1e-4 * k**0.5).all()


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 80),
    k=st.integers(1, 300),
    rows=st.integers(1, 40),
    seed=st.integers(0, 2**31 - 1),
    threads=st.sampled_from([1, 2, 3]),
)
def test_rows_are_invariant(dtype, n, k, rows, seed, threads):
    """A row's result is the same bit for bit alone, among any other rows, in any order, at any thread count."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    assert _violations(lambda t: cl.cpu_linear(t, w, b), x, seed) == 0
    alone = torch.cat([cl.cpu_linear(x[i : i + 1], w, b, threads=1) for i in range(rows)])
    assert torch.equal(cl.cpu_linear(x, w, b, threads=threads), alone)


@pytest.mark.parametrize("dtype", DTYPES)
def test_invariance_check_detects_a_row_dependent_product(dtype):
    """Inverse: the same check flags a product that computes one row differently from many (split-K
    for one row, as a BLAS GEMV path or cuBLAS may: two half-K sums, each rounded to the output
    dtype, then added; the kernel for more rows), so the invariance test is not vacuous."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 576, generator=g).to(dtype)
    w = torch.randn(200, 576, generator=g).to(dtype)
    w0, w1 = w[:, :288].contiguous(), w[:, 288:].contiguous()

    def row_dependent(t):
        if t.shape[0] > 1:
            return cl.cpu_linear(t, w)
        return cl.cpu_linear(t[:, :288], w0) + cl.cpu_linear(t[:, 288:], w1)

    assert _violations(row_dependent, x) > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_and_batched_inputs(dtype):
    g = torch.Generator().manual_seed(5)
    big = torch.randn(3, 4, 70, generator=g).to(dtype)
    x = big[..., 3:67]  # [3, 4, 64], rows at stride 70
    w = torch.randn(9, 64, generator=g).to(dtype)
    y = cl.cpu_linear(x, w)
    assert y.shape == (3, 4, 9)
    assert torch.equal(y, cl.cpu_linear(x.contiguous(), w))
    assert torch.equal(y[1, 2], cl.cpu_linear(x[1, 2:3], w)[0])
    empty = cl.cpu_linear(torch.zeros(0, 64, dtype=dtype), w)
    assert empty.shape == (0, 9)


@needs[torch.float32]
def test_bad_inputs_are_named():
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match="one dtype"):
        cl.cpu_linear(torch.randn(2, 8, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="one dtype"):
        cl.cpu_linear(torch.randn(2, 8), w.bfloat16())
    with pytest.raises(ValueError, match=r"contiguous \[N, K=8\] weight"):
        cl.cpu_linear(torch.randn(2, 8), torch.randn(8, 4).t())
    with pytest.raises(ValueError, match=r"contiguous \[N, K=8\] weight"):
        cl.cpu_linear(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match=r"bias must be a contiguous \[4\]"):
        cl.cpu_linear(torch.randn(2, 8), w, torch.randn(5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_row_limit_of_prompt_forwards(monkeypatch, dtype):
    """In a prompt's forward (``prompt=True``) float32 calls above ``MAX_ROWS_F32`` rows run F.linear;
    bfloat16 ones, and every call of a decode round (``prompt=False``: a verify's rows must round like
    a decode step's), stay on the kernel up to ``MAX_ROWS`` (counted at its launch)."""
    if cl.available(dtype) is not None:
        pytest.skip(f"no CPU kernel for {dtype} here: {cl.available(dtype)}")
    monkeypatch.setattr(cl, "SIZE_FLOORS", False)
    monkeypatch.setattr(cl, "MAX_ROWS_F32", 7)  # the limit is per dtype, whatever its value on this CPU
    launches = []
    launch = cl._launch
    monkeypatch.setattr(cl, "_launch", lambda *a: launches.append(a[0].shape[0]) or launch(*a))
    g = torch.Generator().manual_seed(11)
    w = torch.randn(300, 96, generator=g).to(dtype)
    limit = 7 if dtype == torch.float32 else cl.MAX_ROWS
    at, above = (torch.randn(n, 96, generator=g).to(dtype) for n in (limit, limit + 1))
    y = cl.linear(at, w, prompt=True)
    assert launches == [limit] and torch.equal(y, cl.cpu_linear(at, w))  # the kernel ran
    launches.clear()
    y = cl.linear(above, w, prompt=True)
    assert launches == [] and torch.equal(y, F.linear(above, w))
    if dtype == torch.float32:  # the inverse: the same rows in a decode round run the kernel
        assert torch.equal(cl.linear(above, w), cl.cpu_linear(above, w)) and launches == [limit + 1] * 2
    assert cl.MAX_ROWS_F32 <= cl.MAX_ROWS


def test_torch_ops_route_only_prompt_forwards(monkeypatch):
    """``TorchOps.begin_forward(prompt=True)`` (``TargetModel.forward`` passes ``meta.prefill``) sends
    the forward's linear calls with ``prompt=True``; the next forward without it does not."""
    from tritonspec.runtime.ops import TorchOps

    seen = []
    monkeypatch.setattr(cl, "linear", lambda x, w, b=None, prompt=False: seen.append(prompt) or F.linear(x, w, b))
    ops = TorchOps()
    monkeypatch.setattr(ops, "_cpu_kernel", lambda dtype: True)
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    ops.begin_forward(prompt=True)
    ops.linear(x, w)
    ops.begin_forward()
    ops.linear(x, w)
    assert seen == [True, False]


def test_only_prompt_forwards_are_flagged_a_prompt(monkeypatch):
    """``TargetModel.forward`` passes ``meta.prefill`` to ``begin_forward``, and so does the drafter's step: a
    generation flags its target's prompt forward and (speculative) the drafter's prompt catch-up right after it,
    and no verify, decode step or decode-round drafter forward."""
    from _util import perm_pair, random_prompts, runtime

    flags = []
    begin = TorchOps.begin_forward
    monkeypatch.setattr(
        TorchOps, "begin_forward", lambda self, prompt=False: flags.append(prompt) or begin(self, prompt)
    )
    model, drafter = perm_pair("llama", vocab=24, seed=0)
    for speculative in (False, True):
        flags.clear()
        runtime(model, drafter, spec=None).generate(
            random_prompts(24, [9], seed=1), max_new_tokens=5, speculative=speculative
        )
        prompts = 2 if speculative else 1
        assert flags[:prompts] == [True] * prompts and flags.count(True) == prompts and len(flags) > prompts + 1


@needs[torch.float32]
@pytest.mark.parametrize("floors", [True, False])
def test_dispatch_falls_back_where_the_kernel_does_not_apply(monkeypatch, floors):
    """``linear``: a [K, N]-stored weight, autograd, more than MAX_ROWS rows or (with the size floors,
    Intel CPUs) a weight below MIN_WEIGHT elements or MIN_K columns run F.linear exactly; the rest the
    kernel (without the floors, small weights too)."""
    monkeypatch.setattr(cl, "SIZE_FLOORS", floors)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(6, 10, generator=g)
    x = torch.randn(3, 10, generator=g)
    kn = w.t().contiguous().t()
    assert torch.equal(cl.linear(x, kn), F.linear(x, kn))
    xg = x.clone().requires_grad_()
    y = cl.linear(xg, w)
    y.sum().backward()
    assert torch.allclose(xg.grad, w.sum(0).expand(3, 10))
    many = torch.randn(cl.MAX_ROWS + 1, 10, generator=g)
    assert torch.equal(cl.linear(many, w), F.linear(many, w))
    small = F.linear if floors else cl.cpu_linear
    assert torch.equal(cl.linear(x, w), small(x, w))  # below MIN_WEIGHT: in cache, MKL is faster on Intel
    xk = torch.randn(3, cl.MIN_K, generator=g)
    big = torch.randn(cl.MIN_WEIGHT // cl.MIN_K + 1, cl.MIN_K, generator=g)
    assert torch.equal(cl.linear(xk, big), cl.cpu_linear(xk, big))
    narrow = torch.randn(cl.MIN_WEIGHT // 10 + 1, 10, generator=g)  # many elements, K below MIN_K
    assert torch.equal(cl.linear(x, narrow), small(x, narrow))
    assert not torch.equal(cl.cpu_linear(x, narrow), F.linear(x, narrow))  # the two paths are told apart


@needs[torch.float32]
def test_backend_mode(monkeypatch):
    """``TRITONSPEC_CPU_LINEAR``: ``torch`` gives F.linear bit for bit, ``auto`` the kernel; a bad value is named."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(cl.MIN_WEIGHT // 576 + 1, 576, generator=g)
    x = torch.randn(1, 576, generator=g)
    monkeypatch.setenv("TRITONSPEC_CPU_LINEAR", "torch")
    assert torch.equal(TorchOps().linear(x, w), F.linear(x, w))
    assert cl.cpu_linear_status()["float32"].startswith("torch (TRITONSPEC_CPU_LINEAR=torch")
    monkeypatch.setenv("TRITONSPEC_CPU_LINEAR", "auto")
    assert torch.equal(TorchOps().linear(x, w), cl.cpu_linear(x, w))
    assert cl.cpu_linear_status()["float32"] == "kernel"
    monkeypatch.setenv("TRITONSPEC_CPU_LINEAR", "fast")
    with pytest.raises(ValueError, match="TRITONSPEC_CPU_LINEAR='fast' is not one of"):
        TorchOps().linear(x, w)


def test_build_failure_falls_back_or_is_named(monkeypatch, tmp_path):
    """A compiler that fails: ``auto`` runs F.linear and says why; ``kernel`` raises with the reason."""
    monkeypatch.setenv("TRITONSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # exists, always fails
    cl._library.cache_clear()
    cl.available.cache_clear()
    try:
        why = cl.available(torch.float32)
        assert why is not None
        if cl.isa() is None:
            assert "AVX-512" in why and "AVX2" in why
        else:
            assert why.startswith("building linear.c, attention.c") and "with false failed" in why
        monkeypatch.setenv("TRITONSPEC_CPU_LINEAR", "auto")
        assert not cl.enabled(torch.float32)
        x, w = torch.randn(2, 8), torch.randn(3, 8)
        assert torch.equal(TorchOps().linear(x, w), F.linear(x, w))
        monkeypatch.setenv("TRITONSPEC_CPU_LINEAR", "kernel")
        with pytest.raises(cl.CpuLinearUnavailable, match="use 'auto' to fall back"):
            cl.enabled(torch.float32)
    finally:
        cl._library.cache_clear()
        cl.available.cache_clear()


@needs[torch.float32]
def test_compiled_call_is_the_same_kernel():
    """Under torch.compile the kernel runs as the custom op ``tritonspec::cpu_linear``: same bits as eager."""
    g = torch.Generator().manual_seed(13)
    w = torch.randn(cl.MIN_WEIGHT // cl.MIN_K, cl.MIN_K, generator=g)  # the smallest weight the kernel runs
    x = torch.randn(3, cl.MIN_K, generator=g)

    def f(t):
        return torch.nn.functional.silu(cl.linear(t, w)) * 2

    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), f(x))


@needs[torch.float32]
def test_deterministic_mode_runs_the_kernel_for_every_row_count():
    """Deterministic mode's linear layers run the kernel unprobed, prompts above MAX_ROWS included."""
    from tritonspec.runtime.deterministic import DeterministicOps

    ops = DeterministicOps(TorchOps(), "cpu")
    g = torch.Generator().manual_seed(17)
    w = torch.randn(40, 24, generator=g)
    x = torch.randn(cl.MAX_ROWS + 44, 24, generator=g)
    full = ops.linear(x, w)
    assert torch.equal(full, cl.cpu_linear(x, w))
    assert torch.equal(ops.linear(x[7:8], w), full[7:8])
    assert [p.method for p in ops.probes if p.op == "linear"] == ["kernel"]
    blas = DeterministicOps(TorchOps("torch"), "cpu", max_rows=8)
    blas.linear(x[:3], w)
    assert [p.method for p in blas.probes if p.op == "linear"] != ["kernel"]


@needs[torch.float32]
def test_native_operator_equals_the_ctypes_path():
    """``torch.ops.tritonspec_cpu.linear`` (built where a C++ compiler and torch's headers are) runs
    the same kernel as the ctypes path: same bits, any thread count."""
    import shutil

    why = cl.native_op()
    if why is not None:
        assert shutil.which("g++") is None and shutil.which("c++") is None, why  # only a missing compiler excuses it
        pytest.skip(f"native operator not built: {why}")
    g = torch.Generator().manual_seed(19)
    for dtype in [dt for dt in WHY if WHY[dt] is None]:
        for m, n, k in ((1, 7, 13), (5, 99, 300), (17, 64, 576)):
            x = torch.randn(2, m, k, generator=g).to(dtype)
            w = torch.randn(n, k, generator=g).to(dtype)
            b = torch.randn(n, generator=g).to(dtype)
            ref = cl._launch_ctypes(x, w, b, None)
            for threads in (-1, 1, 3):
                assert torch.equal(torch.ops.tritonspec_cpu.linear(x, w, b, threads), ref)
            one = x[:, :1]  # strided rows
            assert torch.equal(torch.ops.tritonspec_cpu.linear(one, w, None), cl._launch_ctypes(one, w, None, 1))
    with pytest.raises(RuntimeError, match="contiguous \\[N, K\\] weight"):
        torch.ops.tritonspec_cpu.linear(torch.randn(2, 8), torch.randn(8, 4).t(), None)


@needs[torch.float32]
@pytest.mark.parametrize("spec", [(3, 1, 4), (3, 2, 7)], ids=["chain", "tree"])
def test_speculative_equals_plain_through_the_kernel(monkeypatch, spec):
    """End to end, every linear layer on the kernel: greedy speculative output equals plain output
    in the default mode (the kernel's size floors lowered to the tiny targets'), and in deterministic
    mode (the kernel for every weight) seeded sampling too, batch 1 and 4."""
    import tritonspec as ts

    from _util import perm_pair, random_prompts, runtime

    monkeypatch.setattr(cl, "MIN_WEIGHT", 1)
    monkeypatch.setattr(cl, "MIN_K", 1)
    calls = []
    real = cl._launch
    monkeypatch.setattr(cl, "_launch", lambda *a: calls.append(1) or real(*a))  # kernel calls only
    model, drafter = perm_pair("llama", vocab=24, seed=5, alpha=0.4)
    prompts = random_prompts(24, [3, 7, 12, 5], seed=1)
    for deterministic in (False, True):
        rt = runtime(model, drafter, ts.SpecConfig(*spec), max_batch_size=4, deterministic=deterministic)
        sampled = [dict(temperature=1.0, seed=[3, 1, 4, 1])] if deterministic else []
        for kw in [dict(), *sampled]:
            for batch in (prompts[:1], prompts):
                kw_b = {k: (v[: len(batch)] if k == "seed" else v) for k, v in kw.items()}
                a = rt.generate(batch, max_new_tokens=32, **kw_b)
                b = rt.generate(batch, max_new_tokens=32, speculative=False, **kw_b)
                assert a.token_ids == b.token_ids, (deterministic, kw)
                assert a.stats.num_drafts > 0
        assert rt.ops._kernel_for[torch.float32]
        if deterministic:
            assert {p.method for p in rt.ops.probes if p.op == "linear"} == {"kernel"}
        else:
            assert len(calls) > 1000  # the default mode's linear layers ran the kernel, not F.linear


def test_runtime_option_is_checked():
    import tritonspec as ts

    from _util import tiny_target

    with pytest.raises(ts.UserError, match="cpu_linear='fast' is not one of"):
        ts.SpeculativeRuntime.from_pretrained(tiny_target("llama", seed=0), cpu_linear="fast")


def test_every_kernel_source_is_built_keyed_and_packaged():
    """Every local header a C source includes is in the build key (``HEADERS``: an edit rebuilds), and
    the package data ships every file of ``kernels/cpu`` (a wheel without ``hsum.h`` cannot build)."""
    import fnmatch
    import re

    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+ (reading pyproject.toml)")

    folder = cl.SOURCE.parent
    included = {
        name
        for src in [*cl.SOURCES, cl.OP_SOURCE, *cl.HEADERS]
        for name in re.findall(r'#include "([^"]+)"', src.read_text())
    }
    assert included and included <= {h.name for h in cl.HEADERS}, included
    pyproject = tomllib.loads((folder.parents[1] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["tritonspec.kernels"]
    shipped = [f.name for f in folder.iterdir() if any(fnmatch.fnmatch(f"cpu/{f.name}", g) for g in globs)]
    assert sorted(shipped) == sorted(f.name for f in folder.iterdir() if f.is_file()), (shipped, globs)


@pytest.mark.skipif(cl._compiler() is None, reason="no C compiler here (set CC, or install gcc)")
@pytest.mark.parametrize("march", ["haswell", "skylake-avx512", "icelake-server", "sapphirerapids"])
def test_sources_build_for_every_supported_isa(march):
    """The kernel sources compile for each instruction set they claim, whatever CPU runs the test:
    AVX2 + FMA (Haswell, Zen 1-3; avx2.h), AVX-512 without AVX512-BF16 (Skylake-SP, Ice Lake: avx2.h
    supplies VDPBF16PS; before it, linear.c failed to build there and the CPU kernels were lost in
    both dtypes), and AVX-512 with BF16 and AMX (Sapphire Rapids). -O0: always_inline target errors
    still show, in a fraction of the time."""
    import subprocess

    for src in cl.SOURCES:
        cmd = [cl._compiler(), "-O0", f"-march={march}", "-fopenmp", "-std=gnu11", "-fPIC", "-c", str(src)]
        r = subprocess.run([*cmd, "-o", "/dev/null"], capture_output=True, text=True)
        assert r.returncode == 0, f"{src.name} for -march={march}:\n{r.stderr[-1500:]}"


@needs[torch.float32]
def test_kernel_digest_is_stable_and_sees_one_changed_bit(monkeypatch):
    """``kernel_digest``: the same value twice, one per dtype, and a different one when a single
    output element of the linear kernel moves by one ulp (the inverse: it is not vacuous)."""
    d32 = cl.kernel_digest(torch.float32)
    assert d32 == cl.kernel_digest(torch.float32) and len(d32) == 16
    if WHY[torch.bfloat16] is None:
        assert cl.kernel_digest(torch.bfloat16) != d32
    real = cl.cpu_linear

    def one_ulp_off(x, w, b=None, threads=None):
        y = real(x, w, b, threads)
        y.view(-1)[-1] = torch.nextafter(y.view(-1)[-1], torch.tensor(float("inf"), dtype=y.dtype))
        return y

    monkeypatch.setattr(cl, "cpu_linear", one_ulp_off)
    assert cl.kernel_digest(torch.float32) != d32
