"""The row-invariant CPU attention and RMSNorm kernels (``kernels/cpu_attention.py``,
``kernels/cpu_norm.py``; issues 21 and 16): close to the references, a tree node's attention equal
bit for bit to the same token decoded alone after its ancestors, rows independent of the batch and
the thread count, the same bits compiled, and speculative = plain end to end in bfloat16."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonspec.kernels import cpu_attention as ca
from tritonspec.kernels import cpu_linear as cl
from tritonspec.kernels import cpu_norm as cn
from tritonspec.kernels.aux_gather import aux_gather_reference
from tritonspec.kernels.rms_norm import rms_norm_reference
from tritonspec.kernels.tree_attention import tree_attention_reference
from tritonspec.runtime.ops import TorchOps

WHY = cl.available(torch.float32)
needs_kernels = pytest.mark.skipif(WHY is not None, reason=f"CPU kernels unavailable here: {WHY}")
pytestmark = needs_kernels
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16")]


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
    """float32: to float32 rounding; bfloat16: within two bfloat16 steps of the float32 result."""
    if dtype == torch.float32:
        return torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    return bool(((out.float() - ref).abs() <= ref.abs() * 2.0**-7 + 2e-3).all())


def _random_case(g, dtype, B, Q, Hq, Hkv, D, S, T, p_mask=0.5):
    q = torch.randn(B, Q, Hq, D, generator=g).to(dtype)
    kc = torch.randn(B + 1, S, Hkv, D, generator=g).to(dtype)  # one spare batch row, as B_max > B
    vc = torch.randn(B + 1, S, Hkv, D, generator=g).to(dtype)
    pl = torch.randint(0, S - T + 1, (B,), generator=g)
    tm = torch.rand(B, Q, T, generator=g) < p_mask
    return q, kc, vc, pl, tm


# ------------------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",  # B, Q, Hq, Hkv, D, S, T
    [(1, 1, 9, 3, 64, 300, 1), (2, 5, 4, 2, 32, 130, 5), (3, 7, 6, 3, 20, 99, 7), (1, 3, 1, 1, 17, 200, 3),
     (4, 1, 8, 8, 16, 1, 1), (1, 11, 16, 1, 128, 77, 11), (2, 2, 2, 1, 7, 65, 2),
     (2, 4, 6, 2, 64, 400, 200), (1, 3, 4, 4, 32, 300, 130)],  # T > 64: the mask scanned 64 bytes at a time
)  # fmt: skip
def test_attention_matches_reference(dtype, shape):
    B, Q, Hq, Hkv, D, S, T = shape
    g = torch.Generator().manual_seed(sum(shape))
    q, kc, vc, pl, tm = _random_case(g, dtype, *shape)
    out = ca.cpu_tree_attention(q, kc, vc, pl, tm, D**-0.5)
    ref = tree_attention_reference(q.float(), kc.float(), vc.float(), pl, tm, D**-0.5)
    assert out.dtype == dtype and out.shape == (B, Q, Hq, D)
    assert _close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefix", [0, 10, 63])
def test_wide_mask_scan_equals_the_strided_scan(dtype, prefix):
    """A unit-stride mask row is scanned 64 bytes at a time, a strided one byte by byte: the same
    visible slots, so the same bits, including blocks of 64 keys that fill in the middle of a chunk."""
    g = torch.Generator().manual_seed(prefix)
    q, kc, vc, _, _ = _random_case(g, dtype, 2, 5, 4, 2, 32, 520, 300)
    pl = torch.tensor([prefix, prefix + 7])
    for density in (0.05, 0.5, 0.97):
        wide = torch.rand(2, 300, 5, generator=g) < density
        strided = wide.transpose(1, 2)  # [B, Q, T] at stride Q along T
        out = ca.cpu_tree_attention(q, kc, vc, pl, strided.contiguous(), 32**-0.5)
        assert torch.equal(out, ca.cpu_tree_attention(q, kc, vc, pl, strided, 32**-0.5))
        ref = tree_attention_reference(q.float(), kc.float(), vc.float(), pl, strided, 32**-0.5)
        assert _close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_edges(dtype):
    """No visible slot gives zeros; kv_len bounds the slots read; a non-contiguous mask is read at its
    strides; prefix_lens past the cache end reads the cache only."""
    g = torch.Generator().manual_seed(3)
    q, kc, vc, pl, tm = _random_case(g, dtype, 2, 3, 4, 2, 16, 40, 3)
    pl = torch.tensor([0, 10])
    tm[0] = False
    out = ca.cpu_tree_attention(q, kc, vc, pl, tm, 0.25)
    assert (out[0] == 0).all() and (out[1] != 0).any()
    ref = tree_attention_reference(q.float(), kc.float(), vc.float(), pl, tm, 0.25, kv_len=12)
    assert _close(ca.cpu_tree_attention(q, kc, vc, pl, tm, 0.25, kv_len=12), ref, dtype)
    wide = torch.rand(2, 3, 7, generator=g) < 0.5
    assert torch.equal(
        ca.cpu_tree_attention(q, kc, vc, pl, wide[:, :, 1:4], 0.25),
        ca.cpu_tree_attention(q, kc, vc, pl, wide[:, :, 1:4].contiguous(), 0.25),
    )
    neg = torch.tensor([1, -2])  # slots below 0 are never read (the reference's mask), not out of bounds
    tm[1, :, 2] = True  # row 1 sees tree slot 0 (t = 2) at least
    ref = tree_attention_reference(q.float(), kc.float(), vc.float(), neg, tm, 0.25)
    assert _close(ca.cpu_tree_attention(q, kc, vc, neg, tm, 0.25), ref, dtype)
    far = ca.cpu_tree_attention(q, kc, vc, torch.tensor([500, 500]), tm, 0.25)
    assert _close(
        far, tree_attention_reference(q.float(), kc.float(), vc.float(), torch.tensor([40, 40]), tm, 0.25), dtype
    )


def _tree(parents: list[int]) -> torch.Tensor:
    """[N, N] ancestor-or-self mask of a tree given by parent ids (parent < child)."""
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def _verify_vs_decode_mismatches(attn, q, kc, vc, prefix: int, parents: list[int]) -> int:
    """Nodes whose attention in one tree call differs, bit for bit, from the same query decoded alone
    after its ancestors were committed (their K/V copied to consecutive slots after the prefix)."""
    N = len(parents)
    mask = _tree(parents)
    full = attn(q, kc, vc, torch.tensor([prefix]), mask[None], q.shape[-1] ** -0.5)
    bad = 0
    for i in range(N):
        path = [j for j in range(N) if mask[i, j]]  # ancestors then i, ascending
        k2, v2 = kc.clone(), vc.clone()
        k2[0, prefix : prefix + len(path)] = kc[0, [prefix + j for j in path]]
        v2[0, prefix : prefix + len(path)] = vc[0, [prefix + j for j in path]]
        one = attn(
            q[:, i : i + 1],
            k2,
            v2,
            torch.tensor([prefix + len(path) - 1]),
            torch.ones(1, 1, 1, dtype=torch.bool),
            q.shape[-1] ** -0.5,
        )
        bad += int(not torch.equal(one[:, 0], full[:, i]))
    return bad


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=20, deadline=None)
@given(
    parents_seed=st.integers(0, 10**6),
    n=st.integers(1, 12),
    prefix=st.integers(0, 200),
    heads=st.sampled_from([(9, 3, 64), (4, 4, 16), (6, 1, 20), (2, 2, 7)]),
)
def test_tree_node_equals_its_decode_step(dtype, parents_seed, n, prefix, heads):
    """The property speculative = plain rests on: a verified tree node's attention is the attention
    of the same token decoded alone after its accepted ancestors, bit for bit (any prefix length,
    with the 64-key block edges falling anywhere)."""
    g = torch.Generator().manual_seed(parents_seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    Hq, Hkv, D = heads
    q = torch.randn(1, n, Hq, D, generator=g).to(dtype)
    kc = torch.randn(1, prefix + n + 1, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(1, prefix + n + 1, Hkv, D, generator=g).to(dtype)
    assert _verify_vs_decode_mismatches(ca.cpu_tree_attention, q, kc, vc, prefix, parents) == 0


def test_tree_node_check_detects_sdpa():
    """Inverse: the same check on PyTorch's SDPA path (float32, where one query and many round
    differently on this CPU) finds mismatches, so the property above is not vacuous."""
    ops = TorchOps("torch")

    def sdpa(*a):
        ops.begin_forward()
        return ops.tree_attention(*a)

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 7, 8, 32, generator=g)
    kc, vc = torch.randn(1, 260, 2, 32, generator=g), torch.randn(1, 260, 2, 32, generator=g)
    assert _verify_vs_decode_mismatches(sdpa, q, kc, vc, 200, [-1, 0, 1, 1, 0, 4, 2]) > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_independent_of_batch_and_threads(dtype):
    g = torch.Generator().manual_seed(7)
    q, kc, vc, pl, tm = _random_case(g, dtype, 4, 5, 9, 3, 64, 300, 5)
    full = ca.cpu_tree_attention(q, kc, vc, pl, tm, 0.125)
    for b in range(4):
        for threads in (1, 2, 3):
            one = ca.cpu_tree_attention(
                q[b : b + 1], kc[b : b + 1], vc[b : b + 1], pl[b : b + 1], tm[b : b + 1], 0.125, threads=threads
            )
            assert torch.equal(one[0], full[b])


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 3),
    Q=st.integers(2, 40),
    heads=st.sampled_from([(4, 2, 32), (9, 3, 64), (5, 5, 16), (16, 1, 16), (2, 1, 40)]),
    prefixes=st.lists(st.integers(0, 300), min_size=3, max_size=3),
    threads=st.integers(1, 3),
    seed=st.integers(0, 10**6),
)
def test_shared_prefix_path_is_each_query_alone(dtype, B, Q, heads, prefixes, threads, seed):
    """Several queries over a prefix holding full 64-key blocks run those blocks query after query in
    groups (attention.c's shared-prefix path; groups of up to 16 queries, split for the threads): every
    query's output is the one it gets alone (a one-query call, the per-query path), bit for bit, and the
    one of the whole call with the path switched off (``TRITONSPEC_CPU_ATTENTION_SHARED=0``), for ragged
    prefixes (some rows under one block, one past the cache, one negative), any group split and thread
    count."""
    import os

    os.environ.pop("TRITONSPEC_CPU_ATTENTION_SHARED", None)
    Hq, Hkv, D = heads
    g = torch.Generator().manual_seed(seed)
    T = 6
    S = max(prefixes[:B]) + T + 2
    q = torch.randn(B, Q, Hq, D, generator=g).to(dtype)
    kc = torch.randn(B, S, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(B, S, Hkv, D, generator=g).to(dtype)
    pl = torch.tensor(prefixes[:B])
    if B == 3 and seed % 3 == 0:  # a row past the cache (reads the cache only), a negative one (nothing)
        pl[1], pl[2] = S + 5, -70
    tm = torch.rand(B, Q, T, generator=g) < 0.5
    full = ca.cpu_tree_attention(q, kc, vc, pl, tm, D**-0.5, threads=threads)
    os.environ["TRITONSPEC_CPU_ATTENTION_SHARED"] = "0"
    try:
        per_query = ca.cpu_tree_attention(q, kc, vc, pl, tm, D**-0.5, threads=threads)
    finally:
        del os.environ["TRITONSPEC_CPU_ATTENTION_SHARED"]
    assert torch.equal(full, per_query)
    for b in range(B):
        for i in range(Q):
            one = ca.cpu_tree_attention(
                q[b : b + 1, i : i + 1], kc[b : b + 1], vc[b : b + 1], pl[b : b + 1], tm[b : b + 1, i : i + 1],
                D**-0.5, threads=1,
            )  # fmt: skip
            assert torch.equal(one[0, 0], full[b, i]), (b, i)
    if (pl >= 0).all() and (pl <= S - T).all():  # the reference's slot convention
        ref = tree_attention_reference(q.float(), kc.float(), vc.float(), pl, tm, D**-0.5)
        assert _close(full, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "Q, heads, prefix",
    [(12, (4, 2, 32), 800), (7, (9, 3, 64), 130), (16, (4, 1, 48), 64), (2, (4, 2, 32), 700), (4, (4, 4, 32), 200)],
)
def test_transposed_scores_are_the_lane_sum_scores(dtype, Q, heads, prefix):
    """The shared-prefix path's transposed scores (``set_transposed_scores``; AVX-512) give the bits of the
    lane-sum path they replace: head dims 32, 64 and 48 (a masked last chunk), bfloat16 storage, rows with
    different prefixes, groups of as few as ``KT_MIN_ROWS`` = 4 (query, head) rows (2 queries x 2 heads, 4 x 1).
    Inverse: the transposed blocks counter moves only while they are on."""
    if cl.native_op() is not None:
        pytest.skip(f"native operator not built: {cl.native_op()}")
    Hq, Hkv, D = heads
    g = torch.Generator().manual_seed(Q)
    S = prefix + Q + 4
    q = torch.randn(2, Q, Hq, D, generator=g).to(dtype)
    kc, vc = torch.randn(2, S, Hkv, D, generator=g).to(dtype), torch.randn(2, S, Hkv, D, generator=g).to(dtype)
    pl, tm = torch.tensor([prefix, prefix // 2 + 64]), torch.rand(2, Q, Q, generator=g) < 0.6
    before = ca.transposed_blocks()
    on = ca.cpu_tree_attention(q, kc, vc, pl, tm, D**-0.5, threads=1)
    ran = ca.transposed_blocks() - before
    old = ca.set_transposed_scores(False)
    try:
        off = ca.cpu_tree_attention(q, kc, vc, pl, tm, D**-0.5, threads=2)
        assert ca.transposed_blocks() == before + ran
    finally:
        ca.set_transposed_scores(old)
    assert torch.equal(on, off)
    if cl.isa() == "avx512":  # AVX2 runs the shared blocks query by query
        assert ran >= prefix // 64
    assert not torch.equal(on[:, :, 0], on[:, :, 1])  # the heads differ: the comparison is not vacuous


def test_attention_bad_inputs_are_named():
    q, k = torch.randn(1, 2, 4, 16), torch.randn(1, 9, 3, 16)
    with pytest.raises(ValueError, match="Hq a multiple of Hkv"):
        ca.cpu_tree_attention(q, k, k, torch.tensor([7]), torch.ones(1, 2, 2, dtype=torch.bool), 0.25)
    k = torch.randn(1, 9, 2, 16)
    with pytest.raises(ValueError, match="tree_mask must be"):
        ca.cpu_tree_attention(q, k, k, torch.tensor([7]), torch.ones(1, 3, 2, dtype=torch.bool), 0.25)
    assert (
        ca.tree_attention(q.half(), k.half(), k.half(), torch.tensor([7]), torch.ones(1, 2, 2, dtype=torch.bool), 0.25)
        is None
    )


# ---------------------------------------------------------------------------------------------- norm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mh", [(1, 576), (7, 99), (70, 576), (3, 17), (1, 1), (130, 33)])
@pytest.mark.parametrize("residual", [False, True])
def test_norm_matches_reference(dtype, mh, residual):
    m, h = mh
    g = torch.Generator().manual_seed(m * 7 + h)
    x, r = torch.randn(m, h, generator=g).to(dtype), torch.randn(m, h, generator=g).to(dtype)
    w = torch.randn(h, generator=g).to(dtype)
    out = cn.cpu_rms_norm(x, w, 1e-5, r if residual else None)
    ref = rms_norm_reference(x, w, 1e-5, r if residual else None)
    if residual:
        assert torch.equal(out[1], ref[1])  # the residual sum is PyTorch's add, bit for bit
        out, ref = out[0], ref[0]
    assert out.dtype == dtype and out.shape == (m, h)
    assert _close(out, ref.float(), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 90), h=st.integers(1, 700), seed=st.integers(0, 10**6), threads=st.integers(1, 3))
def test_norm_rows_are_invariant(dtype, rows, h, seed, threads):
    g = torch.Generator().manual_seed(seed)
    x, r = torch.randn(rows, h, generator=g).to(dtype), torch.randn(rows, h, generator=g).to(dtype)
    w = torch.randn(h, generator=g).to(dtype)
    y, s = cn.cpu_rms_norm(x, w, 1e-6, r)
    for i in {0, rows // 2, rows - 1}:
        yi, si = cn.cpu_rms_norm(x[i : i + 1], w, 1e-6, r[i : i + 1], threads=threads)
        assert torch.equal(yi[0], y[i]) and torch.equal(si[0], s[i])
    assert torch.equal(cn.cpu_rms_norm(x[None, :, :], w, 1e-6)[0], cn.cpu_rms_norm(x, w, 1e-6))  # 3-D = 2-D


def test_norm_bad_inputs_are_named():
    with pytest.raises(ValueError, match="cpu_rms_norm takes"):
        cn.cpu_rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    assert cn.rms_norm(torch.randn(2, 8).half(), torch.randn(8).half(), 1e-6) is None


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=25, deadline=None)
@given(
    n_src=st.integers(1, 9), n_aux=st.integers(1, 3), h=st.sampled_from([1, 7, 32, 99, 128]),
    seed=st.integers(0, 10**6), index=st.lists(st.integers(-3, 8), min_size=1, max_size=12), norm=st.booleans(),
)  # fmt: skip
def test_aux_gather_is_the_norm_kernel_per_chunk(dtype, n_src, n_aux, h, seed, index, norm):
    """The native fc_norm gather: each gathered chunk is cpu_rms_norm's output on it bit for bit (so within the
    reference's rounding), negative indices give zero rows, a plain gather is the reference's copy."""
    if cl.native_op() is not None:
        pytest.skip(f"native operator not built: {cl.native_op()}")
    g = torch.Generator().manual_seed(seed)
    aux = (torch.randn(n_src, n_aux * h, generator=g) * 3).to(dtype)
    w = torch.randn(n_aux, h, generator=g).to(dtype) if norm else None
    idx = torch.tensor([i % n_src if i >= 0 else i for i in index])
    out = cn.aux_gather(aux, idx, w, 1e-6)
    assert out is not None and out.shape == (len(index), n_aux * h)
    rows = aux.index_select(0, idx.clamp(min=0)).view(len(index), n_aux, h)
    if norm:
        want = torch.stack([cn.cpu_rms_norm(rows[:, c], w[c], 1e-6) for c in range(n_aux)], 1)
    else:
        want = rows
    want = torch.where((idx >= 0)[:, None], want.reshape(len(index), -1), torch.zeros((), dtype=dtype))
    assert torch.equal(out, want)
    assert _close(out.float(), aux_gather_reference(aux, idx, w, 1e-6).float(), dtype)


def test_aux_gather_inverse_and_routing(monkeypatch):
    """A wrong weight chunk is seen (the comparison is not vacuous); TorchOps routes through the operator only
    where the CPU kernels run, and an out-of-range index is an error naming it."""
    if cl.native_op() is not None:
        pytest.skip(f"native operator not built: {cl.native_op()}")
    g = torch.Generator().manual_seed(3)
    aux, w, idx = torch.randn(4, 3 * 16, generator=g), torch.randn(3, 16, generator=g), torch.tensor([3, -1, 0])
    swapped = w[[1, 0, 2]].contiguous()
    assert not torch.equal(cn.aux_gather(aux, idx, w, 1e-6), cn.aux_gather(aux, idx, swapped, 1e-6))
    with pytest.raises(RuntimeError, match="index 4 outside"):
        cn.aux_gather(aux, torch.tensor([4]), w, 1e-6)
    calls = []
    real = cn.aux_gather
    monkeypatch.setattr(cn, "aux_gather", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        on = TorchOps().aux_gather(aux, idx, w, 1e-6)
        off = TorchOps(cpu_linear="torch").aux_gather(aux, idx, w, 1e-6)
    assert calls == [1] and torch.equal(on, real(aux, idx, w, 1e-6))
    assert torch.equal(off, aux_gather_reference(aux, idx, w, 1e-6))


# ------------------------------------------------------------------------------------------- runtime
def test_native_operators_equal_the_ctypes_path():
    why = cl.native_op()
    if why is not None:
        import shutil

        assert shutil.which("g++") is None and shutil.which("c++") is None, why
        pytest.skip(f"native operator not built: {why}")
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        q, kc, vc, pl, tm = _random_case(g, dtype, 2, 3, 6, 3, 64, 90, 3)
        a = torch.ops.tritonspec_cpu.tree_attention(q, kc, vc, pl, tm, 0.125, -1)
        assert torch.equal(a, ca._launch_ctypes(q, kc, vc, pl, tm, 0.125, -1, None))
        x, w = torch.randn(5, 576, generator=g).to(dtype), torch.randn(576, generator=g).to(dtype)
        y, s = torch.ops.tritonspec_cpu.rms_norm(x, w, 1e-6, x)
        y2, s2 = cn._launch_ctypes(x, w, 1e-6, x, None)
        assert torch.equal(y, y2) and torch.equal(s, s2)


_COMPILED_CHECK = """
import sys, torch
from tritonspec.kernels import cpu_linear as cl
from tritonspec.runtime.ops import TorchOps
if sys.argv[1] == "python-op":
    cl._native_ready = lambda: False  # as where the C++ operator could not be built
from test_cpu_attention_norm import _random_case
ops = TorchOps("kernel")
g = torch.Generator().manual_seed(2)
q, kc, vc, pl, tm = _random_case(g, torch.bfloat16, 1, 4, 9, 3, 64, 70, 4)
x, w = torch.randn(4, 576, generator=g).bfloat16(), torch.randn(576, generator=g).bfloat16()

def f(q, x):
    a = ops.tree_attention(q, kc, vc, pl, tm, 0.125, 70)
    y, s = ops.rms_norm(x, w, 1e-6, x)
    return a, y, s

eager = f(q, x)
compiled = torch.compile(f, fullgraph=True, dynamic=False)(q, x)
assert all(torch.equal(a, b) for a, b in zip(eager, compiled)), "compiled bits differ"
print("same bits")
"""


@pytest.mark.parametrize("native", [True, False], ids=["native-op", "python-op"])
def test_compiled_calls_are_the_same_kernels(native):
    """Under torch.compile both kernels are opaque operators: the same bits as eager (through the
    native operators, and through the Python custom ops when those are missing). In a fresh process:
    the compile must not depend on what earlier tests traced."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if native and cl.native_op() is not None:
        pytest.skip(f"native operator not built: {cl.native_op()}")
    here = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, "-c", _COMPILED_CHECK, "native-op" if native else "python-op"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0 and "same bits" in r.stdout, r.stderr[-3000:]


def test_ops_route_through_the_kernels_only_when_enabled(monkeypatch):
    calls = []
    monkeypatch.setattr(ca, "_launch", lambda *a: calls.append("attention") or ca._launch_ctypes(*a[:6], -1, None))
    monkeypatch.setattr(cn, "_launch", lambda *a: calls.append("norm"))
    g = torch.Generator().manual_seed(4)
    q, kc, vc, pl, tm = _random_case(g, torch.float32, 1, 2, 4, 2, 16, 30, 2)
    TorchOps("torch").tree_attention(q, kc, vc, pl, tm, 0.25)
    TorchOps("torch").rms_norm(q, torch.ones(16), 1e-6)
    assert calls == []
    TorchOps("kernel").tree_attention(q, kc, vc, pl, tm, 0.25)
    TorchOps("kernel").rms_norm(q, torch.ones(16), 1e-6)
    assert calls == ["attention", "norm"]


@pytest.mark.skipif(cl.available(torch.bfloat16) is not None, reason=f"no bf16 kernels: {cl.available(torch.bfloat16)}")
@pytest.mark.parametrize("spec", [(3, 1, 4), (3, 2, 7)], ids=["chain", "tree"])
def test_bfloat16_speculative_equals_plain(monkeypatch, spec):
    """End to end in bfloat16, default mode: with linear layers (size floors lowered to the tiny
    targets'), attention and norms on the row-invariant kernels, greedy speculative output equals
    plain output (before, PyTorch's attention rounded a row by how many shared the call and
    bfloat16 outputs parted at near-ties), batch 1 and 4."""
    import tritonspec as ts

    from _util import perm_pair, random_prompts, runtime

    monkeypatch.setattr(cl, "MIN_WEIGHT", 1)
    monkeypatch.setattr(cl, "MIN_K", 1)

    model, drafter = perm_pair("llama", vocab=24, seed=5, alpha=0.4)
    prompts = random_prompts(24, [3, 7, 12, 5], seed=1)
    rt = runtime(model, drafter, ts.SpecConfig(*spec), max_batch_size=4, dtype=torch.bfloat16)
    assert rt.ops._cpu_kernel(torch.bfloat16)
    for batch in (prompts[:1], prompts):
        a = rt.generate(batch, max_new_tokens=32)
        b = rt.generate(batch, max_new_tokens=32, speculative=False)
        assert a.token_ids == b.token_ids
        assert a.stats.num_drafts > 0


def test_deterministic_mode_runs_the_kernels_and_drops_the_padding_node():
    """Deterministic mode on the CPU kernels: attention and RMSNorm probes are ``kernel`` (attention
    still checked end to end at load), and plain rounds verify the root alone; with
    ``cpu_linear="torch"`` the probed path and its padding node come back. Both equal plain/spec."""
    import tritonspec as ts

    from _util import perm_pair, random_prompts, runtime

    model, drafter = perm_pair("llama", vocab=24, seed=5, alpha=0.4)
    prompts = random_prompts(24, [3, 7, 12], seed=2)
    for choice, kernels in (("auto", True), ("torch", False)):
        rt = runtime(model, drafter, ts.SpecConfig(3, 2, 7), max_batch_size=3, deterministic=True, cpu_linear=choice)
        methods = {p.op: p.method for p in rt.ops.probes if p.op in ("attention", "rms_norm")}
        if kernels:
            assert methods == {"attention": "kernel", "rms_norm": "kernel"}
            assert rt.ops.one_row_invariant and not rt.decoder.pad_root
        else:
            assert "kernel" not in methods.values() and rt.decoder.pad_root
        a = rt.generate(prompts, max_new_tokens=24)
        b = rt.generate(prompts, max_new_tokens=24, speculative=False)
        assert a.token_ids == b.token_ids and a.stats.num_drafts > 0
        assert rt.decoder.root_tree().tokens.shape[1] == (1 if kernels else 2)


def test_deterministic_argmax_keeps_the_lowest_tie_at_any_thread_count():
    """The verify's head argmax runs on the caller's threads in deterministic mode: the same index
    as one thread, ties to the lowest id (planted ties across the split points)."""
    from tritonspec.runtime.deterministic import DeterministicOps

    ops = DeterministicOps(TorchOps(), "cpu")
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(0))
    logits[:, [7, 30000, 49151]] = 100.0
    with ops.threads():
        ops._kernel_threads = 3
        assert torch.get_num_threads() == 1
        got = ops.argmax(logits)
        assert torch.get_num_threads() == 1  # restored
    assert got.tolist() == [7, 7, 7]


# ------------------------------------------------------------------------------------- rope, kv_write
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 9, 64), (2, 3, 4, 16), (3, 7, 1, 2), (1, 5, 3, 128)])
def test_rope_is_the_reference_bit_for_bit(dtype, shape):
    """The C rope rounds as PyTorch's eager ops (each product, then the sum): identical bits, also
    for a strided view (q out of the fused qkv projection)."""
    from tritonspec.kernels import cpu_rope

    B, Q, H, D = shape
    g = torch.Generator().manual_seed(sum(shape))
    wide = torch.randn(B, Q, H + 3, D, generator=g).to(dtype)
    x = wide[:, :, 1 : H + 1]
    cos, sin = (torch.randn(B, Q, 1, D, generator=g).to(dtype) for _ in range(2))
    assert torch.equal(cpu_rope.rope(x, cos, sin), cpu_rope.rope_reference(x, cos, sin))
    if cl.native_op() is None:  # inverse: the kernel ran (the reference alone would pass vacuously)
        assert torch.equal(torch.ops.tritonspec_cpu.rope(x, cos, sin), cpu_rope.rope_reference(x, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layer", [None, 1])
def test_kv_write_is_the_reference(dtype, layer):
    from tritonspec.kernels import cpu_rope
    from tritonspec.kernels.kv_write import kv_write_reference

    g = torch.Generator().manual_seed(5)
    shape = (3, 4, 11, 2, 16) if layer is not None else (4, 11, 2, 16)
    kc, vc = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    slots = torch.tensor([[0, 4, -1], [10, 2, 3]])
    k, v = torch.randn(2, 3, 2, 16, generator=g).to(dtype), torch.randn(2, 3, 2, 16, generator=g).to(dtype)
    cpu_rope.kv_write(kc, vc, slots, k, v, layer)
    kv_write_reference(kc2, vc2, slots, k, v, layer)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    if cl.native_op() is None:
        with pytest.raises(RuntimeError, match="outside"):  # a slot past the cache is refused, nothing written
            cpu_rope.kv_write(kc, vc, torch.tensor([[0, 11, 1], [1, 2, 3]]), k, v, layer)
        assert torch.equal(kc, kc2)


def test_rope_and_kv_write_route_through_the_kernels_only_when_enabled(monkeypatch):
    from tritonspec.kernels import cpu_rope

    if cl.native_op() is not None:
        pytest.skip(f"native operator not built: {cl.native_op()}")
    calls = []
    real = torch.ops.tritonspec_cpu

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(cpu_rope.torch.ops, "tritonspec_cpu", Spy(), raising=False)
    x, c = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 1, 8)
    kc = torch.zeros(1, 5, 3, 8)
    TorchOps("torch").rope(x, c, c)
    TorchOps("torch").kv_write(kc, kc.clone(), torch.tensor([[0, 1]]), x, x)
    assert calls == []
    TorchOps("kernel").rope(x, c, c)
    TorchOps("kernel").kv_write(kc, kc.clone(), torch.tensor([[0, 1]]), x, x)
    assert calls == ["rope", "kv_write"]
