"""Batch-invariant matmul kernel vs its reference (interpreter on a CPU, compiled on a GPU).

Stated bounds: against ``batch_invariant_matmul_reference`` (fp32 accumulation in PyTorch) within
a relative 1e-5 (fp32) / one output ULP (fp16, bf16: both round one fp32 sum once, in a different
order); and batch invariance, bit for bit: a row's result does not depend on how many rows share
the call (1..70), which rows they are, where it sits, or how many batch items the call holds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from tritonspec.kernels.batch_invariant_matmul import (  # noqa: E402
    CONFIGS,
    batch_invariant_linear,
    batch_invariant_matmul,
    batch_invariant_matmul_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-2), torch.bfloat16: (8e-3, 5e-2)}  # (rtol, atol)


@pytest.fixture(autouse=True)
def _row_wise_interpreter_dot(monkeypatch):
    """On a CPU the interpreter runs ``tl.dot`` as one ``np.matmul`` of the tile, and numpy's BLAS
    may round a row differently by its position in the tile (seen with OpenBLAS on AMD Zen 3: 10 of
    16 positions of a [16, 32] @ [32, 32] tile differ from row 0's bits), which a GPU's MMA never
    does. So the interpreter's dot runs row by row here (every row the same [1, K] @ [K, N] product):
    what these tests check is the kernel's own tiling and K loop, not numpy's blocking."""
    if DEVICE != "cpu":
        return
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data[..., :, None, :], b.data[..., None, :, :]  # [..., M, 1, K] @ [..., 1, K, N]
        rows = np.matmul(a_data, b_data, dtype=d.data.dtype)[..., 0, :]
        return TensorHandle(rows + d.data, d.dtype.scalar)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", create_dot)


def _rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype)


@settings(max_examples=12, deadline=None)
@given(
    m=st.sampled_from([1, 3, 33, 70]),
    n=st.sampled_from([1, 17, 64, 97]),
    k=st.sampled_from([1, 12, 64, 130]),
    dtype=st.sampled_from(DTYPES),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_reference(m, n, k, dtype, bias, seed):
    x, w = _rand(m, k, dtype=dtype, seed=seed), _rand(n, k, dtype=dtype, seed=seed + 1)
    b = _rand(n, dtype=dtype, seed=seed + 2) if bias else None
    got = batch_invariant_linear(x, w, b)
    want = batch_invariant_matmul_reference(x, w.t(), b)
    assert got.dtype == dtype and got.shape == (m, n)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_batch_invariant(dtype):
    """Row r of a call with M rows equals the same row computed alone or among others, bit for bit."""
    x, w = _rand(70, 96, dtype=dtype, seed=0), _rand(80, 96, dtype=dtype, seed=1)
    b = _rand(80, dtype=dtype, seed=2)
    full = batch_invariant_linear(x, w, b)
    g = torch.Generator().manual_seed(3)
    for m in (1, 2, 5, 31, 32, 33, 64, 70):
        idx = torch.randperm(70, generator=g)[:m].to(DEVICE)
        assert torch.equal(batch_invariant_linear(x[idx], w, b), full[idx]), m


def test_batched_items_are_invariant_and_match_2d():
    """Item i of a [Bt, M, K] @ [Bt, K, N] call equals the 2-D call on its own, whatever Bt."""
    a, bm = _rand(5, 9, 40, dtype=torch.float32, seed=4), _rand(5, 40, 33, dtype=torch.float32, seed=5)
    full = batch_invariant_matmul(a, bm)
    for i in range(5):
        assert torch.equal(batch_invariant_matmul(a[i], bm[i]), full[i])
        assert torch.equal(batch_invariant_matmul(a[i : i + 1, :3], bm[i : i + 1]), full[i : i + 1, :3])
    shared = batch_invariant_matmul(a, bm[0])  # one [K, N] for every item
    torch.testing.assert_close(shared, batch_invariant_matmul_reference(a, bm[0]), rtol=1e-5, atol=1e-5)


def test_config_is_fixed_per_dtype():
    """One tile configuration per dtype, never chosen by the problem size (no split-K)."""
    assert set(CONFIGS) == set(DTYPES)
    for block_m, block_n, block_k, warps, stages in CONFIGS.values():
        assert min(block_m, block_n, block_k) >= 16 and warps in (4, 8) and stages >= 1


@pytest.mark.parametrize("config", [(16, 16, 32, 2, 2), (32, 16, 16, 1, 1)])
def test_an_override_config_is_batch_invariant_and_validated(config):
    """Any fixed tiling keeps rows invariant (the benchmark compares tilings through ``config``)."""
    a, b = _rand(37, 40, dtype=torch.float32, seed=3), _rand(40, 21, dtype=torch.float32, seed=4)
    full = batch_invariant_matmul(a, b, config=config)
    for rows in (1, 5, 17):
        assert torch.equal(batch_invariant_matmul(a[-rows:], b, config=config), full[-rows:])
    torch.testing.assert_close(full, batch_invariant_matmul_reference(a, b), rtol=1e-5, atol=1e-5)
    for bad in [(16, 16, 32, 3, 2), (16, 24, 32, 4, 2), (8, 16, 32, 4, 2), (16, 16, 32, 4, 0), [16, 16, 32, 4, 2]]:
        with pytest.raises(ValueError, match="BLOCK_M, BLOCK_N, BLOCK_K"):
            batch_invariant_matmul(a, b, config=bad)
    with pytest.raises(ValueError, match="BLOCK_M, BLOCK_N, BLOCK_K"):
        batch_invariant_matmul(a, b, config=(16, 16, 32, True, 2))  # a bool is not a warp count
    with pytest.raises(ValueError, match="shared memory"):
        batch_invariant_matmul(a, b, config=(256, 256, 256, 8, 8))
    with pytest.raises(ValueError, match="BLOCK_M, BLOCK_N, BLOCK_K"):  # checked on an empty problem too
        batch_invariant_matmul(a[:0], b, config=(16, 24, 32, 4, 2))


def test_the_override_config_is_the_one_launched():
    """The inverse of the test above: a config that did nothing would pass its invariance checks, so
    two tilings with another K chunking must round differently, and the linear path passes it on."""
    a, b = _rand(9, 200, dtype=torch.float32, seed=5), _rand(200, 24, dtype=torch.float32, seed=6)
    c16 = batch_invariant_matmul(a, b, config=(16, 16, 16, 1, 1))
    c64 = batch_invariant_matmul(a, b, config=(16, 16, 64, 1, 1))
    assert not torch.equal(c16, c64)  # K summed in 16- vs 64-wide chunks
    w = b.t().contiguous()
    assert torch.equal(batch_invariant_linear(a, w, config=(16, 16, 16, 1, 1)), c16)
    assert torch.equal(batch_invariant_linear(a, w, config=(16, 16, 64, 1, 1)), c64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_split", [64, 128])  # multiples of every dtype's BLOCK_K, and more than one K tile
def test_a_fixed_k_split_is_batch_invariant_and_launched(dtype, k_split):
    """``k_split`` (K in fixed chunks, the chunks' partial products added in order): within the reference's
    bounds, rows bit-identical at every row count and batch item; the inverse: in float32 (BLOCK_K 32) the
    split rounds differently from one pass over K (so the split ran; a split of one K tile would not)."""
    x, w = _rand(37, 200, dtype=dtype, seed=7), _rand(45, 200, dtype=dtype, seed=8)
    b = _rand(45, dtype=dtype, seed=9)
    full = batch_invariant_linear(x, w, b, k_split=k_split)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(
        full.float(), batch_invariant_matmul_reference(x, w.t(), b).float(), rtol=rtol, atol=atol
    )
    for m in (1, 2, 17):
        assert torch.equal(batch_invariant_linear(x[-m:], w, b, k_split=k_split), full[-m:]), m
    a3 = torch.stack([x[:5], x[5:10]])
    got = batch_invariant_matmul(a3, w.t(), b, k_split=k_split)
    assert torch.equal(got[1], full[5:10]) and torch.equal(got[0], full[:5])
    if dtype == torch.float32:
        assert not torch.equal(full, batch_invariant_linear(x, w, b))
    with pytest.raises(ValueError, match="k_split"):
        batch_invariant_linear(x, w, b, k_split=k_split + 8)


def test_k_tiles_keep_their_alignment_specialisation():
    """``K_CHUNK`` (K itself without a split) is specialised as K is: left out (``do_not_specialize``) the
    compiler cannot prove the K tiles 16-byte aligned and drops the asynchronous copies that pipeline
    them (no ``cp.async`` on sm_90 in bfloat16; ``tests/test_compile_ptx.py`` checks the PTX with it)."""
    from tritonspec.kernels.batch_invariant_matmul import _bi_matmul_kernel

    k = _bi_matmul_kernel  # compiled: a JITFunction; under the interpreter: its jit arguments in ``kwargs``
    unspecialised = k.kwargs["do_not_specialize"] if hasattr(k, "kwargs") else k.do_not_specialize
    assert "K_CHUNK" not in unspecialised
    assert "M" in unspecialised  # one compiled kernel for every row count


def test_split_grid_is_bounded():
    a, b = _rand(40000, 1, 64, dtype=torch.float32, seed=0), _rand(64, 8, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match="65535"):
        batch_invariant_matmul(a, b, k_split=32)


def test_rejects_bad_arguments():
    x = _rand(4, 8, dtype=torch.float32, seed=0)
    with pytest.raises(TypeError, match="b must have dtype"):
        batch_invariant_matmul(x, _rand(8, 3, dtype=torch.float16, seed=0))
    with pytest.raises(ValueError, match="do not multiply"):
        batch_invariant_matmul(x, _rand(7, 3, dtype=torch.float32, seed=0))
    with pytest.raises(ValueError, match="bias must have shape"):
        batch_invariant_matmul(x, _rand(8, 3, dtype=torch.float32, seed=0), _rand(4, dtype=torch.float32, seed=0))
    with pytest.raises(ValueError, match=r"a must be \[M, K\]"):
        batch_invariant_matmul(x[None, None], x)
    assert batch_invariant_matmul(x[:0], _rand(8, 3, dtype=torch.float32, seed=0)).shape == (0, 3)


def test_fixed_order_attention_on_this_matmul_is_row_invariant():
    """What deterministic mode runs on a GPU: ``chunked_attention`` with this kernel as its batched
    matmul gives one query the same bits as a decode step and as a branch of a tree (ancestors at
    scattered slots, among other rows)."""
    from tritonspec.runtime.deterministic import chunked_attention, decode_layout

    g = torch.Generator().manual_seed(6)
    hq, hkv, d, n = 2, 1, 16, 70  # two chunks of keys
    k, v, q0 = (torch.randn(*s, generator=g).to(DEVICE) for s in ((1, n + 8, hkv, d), (1, n + 8, hkv, d), (hq, d)))

    def att(q, kk, vv, prefix, mask, kv_len):
        lay = decode_layout(torch.tensor(prefix, device=DEVICE), mask.to(DEVICE), kv_len, need_tail=True)
        return chunked_attention(q, kk, vv, lay, d**-0.5, bmm=batch_invariant_matmul)

    ref = att(q0[None, None], k, v, [n - 1], torch.ones(1, 1, 1, dtype=torch.bool), n)[0, 0]
    kt, vt = torch.cat([k, k]), torch.cat([v, v])
    kt[1, n - 3 + 2], vt[1, n - 3 + 2] = k[0, n - 2], v[0, n - 2]  # row 1: the path 0 -> 2 -> 3
    kt[1, n - 3 + 3], vt[1, n - 3 + 3] = k[0, n - 1], v[0, n - 1]
    mask = torch.eye(4, dtype=torch.bool).repeat(2, 1, 1)
    mask[1, 3, [0, 2]] = True
    qt = torch.randn(2, 4, hq, d, generator=g).to(DEVICE)
    qt[1, 3] = q0
    assert torch.equal(att(qt, kt, vt, [20, n - 3], mask, n + 1)[1, 3], ref)
    exact = (torch.einsum("hd,sd->hs", q0.double(), k[0, :n, 0].double()) * d**-0.5).softmax(-1) @ v[0, :n, 0].double()
    torch.testing.assert_close(ref.double(), exact, rtol=1e-5, atol=1e-5)
