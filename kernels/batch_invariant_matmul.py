"""Batch-invariant matmul: a row's result never depends on how many rows share the call.

    C[b] = A[b] @ B[b] (+ bias)        A [Bt, M, K], B [Bt, K, N] (or [K, N] shared), fp32 accumulation

cuBLAS picks its kernel from the problem size: for a small M it may split K across thread blocks
(split-K) and sum the partial products in another order, so a row of a 1-row decode step and the
same row inside a 48-row verify forward round differently. This kernel has one fixed
configuration per dtype (``CONFIGS``): the output tiles and the K loop never depend on M, there
is no split-K, and every output element accumulates its K products in the same order (K tiles
in ascending order, ``tl.dot`` inside a tile) whatever the row count, the batch size or the
other rows. It is what ``runtime/deterministic.py`` runs for the target's and the drafter's
linear layers (and the chunked attention's small matmuls) on a GPU.

The anchor is the batch-invariant kernels published with "Defeating Nondeterminism in LLM
Inference" (He and Thinking Machines Lab, 2025; github.com/thinking-machines-lab/batch_invariant_ops,
``matmul_kernel_persistent``): fixed tiles, no split-K. Differences here: a plain 3-D grid
(tile of M, tile of N, batch item) instead of a persistent loop, an optional batch axis with
arbitrary strides (so ``x @ weight.T`` needs no copy of the weight), fp32 inputs multiplied in
IEEE fp32 (``input_precision="ieee"``, never TF32) and the output rounded to the input dtype.
"""

from __future__ import annotations

import os

import torch

from .store import config_problem
from .utils import ENABLE_FP_FUSION, FLOAT_DTYPES, check_tensor, require_triton, round_to, tl, triton

# One configuration per dtype, never chosen by the problem size: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
# num_stages). BLOCK_K fixes the reduction chunking; the tiles of M and N only decide which program
# computes an element, not how.
CONFIGS: dict[torch.dtype, tuple[int, int, int, int, int]] = {
    torch.float32: (32, 64, 32, 4, 3),
    torch.float16: (64, 64, 64, 4, 3),
    torch.bfloat16: (64, 64, 64, 4, 3),
}

# Alternative fixed tilings for 16-bit inputs, timed beside CONFIGS by perf/bench_kernels_batch_invariant_matmul.py
# (and compiled for sm_90/sm_80 by tests/test_compile_ptx.py). On the H200 (2026-12-04) the shipped 64 x 64 x 64
# took about 3x cuBLAS's time on the down projection at 1-60 rows (the smaller ones measured the launcher); at one
# row a 4096-wide output gives 64 programs for 132 SMs.
# Any one of them keeps rows batch-invariant; one per weight shape (N, K), never chosen by M, may ship once measured.
# ``BENCH_K_SPLITS``: fixed K chunks (``k_split``) timed the same way: a split fixed by K alone keeps rows invariant.
BENCH_K_SPLITS = (2048, 4096)
BENCH_TILINGS: dict[str, tuple[int, int, int, int, int]] = {
    "n32": (64, 32, 64, 4, 4),
    "m16n32k128": (16, 32, 128, 4, 4),
    "m16n16k256": (16, 16, 256, 2, 3),
}


def batch_invariant_matmul_reference(
    a: torch.Tensor,  # [M, K] or [Bt, M, K]
    b: torch.Tensor,  # [K, N] or [Bt, K, N]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] or [Bt, M, N], dtype of a
    """``a @ b + bias`` accumulated in float32 (PyTorch), rounded once to ``a``'s dtype."""
    out = torch.matmul(a.float(), b.float())
    if bias is not None:
        out = out + bias.float()
    return out.to(a.dtype)


# --------------------------------------------------------------------------------------------
# Triton kernel and launcher
#
# Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), Bt * NSPLIT). Each program owns one BLOCK_M x BLOCK_N
# output tile of one batch item and walks its K range upwards in BLOCK_K steps, accumulating in
# fp32; masked loads fill the ragged edges with zeros (exact: x + 0*y = x). With fp-fusion off the
# bias add rounds separately, as in the reference. NSPLIT = 1 (the default): the range is all of K.
# A fixed K chunk (``k_split``, chosen by the weight's K, never by M) gives NSPLIT ranges
# [s * K_CHUNK, (s + 1) * K_CHUNK): each program stores its fp32 partial tile, and
# ``_bi_reduce_kernel`` adds the partials in ascending s (then the bias), so every row still
# accumulates in one fixed order: more programs for a few rows, the same invariance.
# --------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M", "NSPLIT"])  # K_CHUNK specialised as K was: 16-aligned tiles pipeline
def _bi_matmul_kernel(
    a_ptr,  # [Bt, M, K] at (stride_ab, stride_am, stride_ak)
    b_ptr,  # [Bt, K, N] at (stride_bb, stride_bk, stride_bn); stride_bb = 0 for a shared [K, N]
    c_ptr,  # [Bt, M, N] at (stride_cb, stride_cm, stride_cn); PARTIAL: [NSPLIT, Bt, M, N] fp32 contiguous
    bias_ptr,  # [N] (read when HAS_BIAS and not PARTIAL)
    M,
    N,
    K,
    stride_ab,
    stride_am,
    stride_ak,
    stride_bb,
    stride_bk,
    stride_bn,
    stride_cb,
    stride_cm,
    stride_cn,
    K_CHUNK,  # K per split (K itself when NSPLIT = 1)
    NSPLIT,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    item = (tl.program_id(2) // NSPLIT).to(tl.int64)
    split = tl.program_id(2) % NSPLIT
    k_lo = split * K_CHUNK
    k_hi = tl.minimum(K, k_lo + K_CHUNK)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_base = a_ptr + item * stride_ab + rows[:, None].to(tl.int64) * stride_am
    b_base = b_ptr + item * stride_bb + cols[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):  # ascending K tiles of this split's range
        kk = k0 + ks
        a = tl.load(a_base + kk[None, :] * stride_ak, mask=(rows[:, None] < M) & (kk[None, :] < k_hi), other=0.0)
        b = tl.load(b_base + kk[:, None] * stride_bk, mask=(kk[:, None] < k_hi) & (cols[None, :] < N), other=0.0)
        if UPCAST:  # interpreter only: its bf16 dot reads raw bits; the widening is exact, as in the MMA
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    out_ok = (rows[:, None] < M) & (cols[None, :] < N)
    if PARTIAL:  # this split's fp32 tile; _bi_reduce_kernel adds the splits in order
        bt = tl.num_programs(2) // NSPLIT
        w = c_ptr + ((split * bt + item) * M + rows[:, None].to(tl.int64)) * N + cols[None, :]
        tl.store(w, acc, mask=out_ok)
    else:
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        c = c_ptr + item * stride_cb + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
        tl.store(c, round_to(acc, c_ptr.dtype.element_ty), mask=out_ok)


@triton.jit(do_not_specialize=["total", "N", "NSPLIT"])
def _bi_reduce_kernel(
    w_ptr,  # [NSPLIT, total] fp32: the splits' partial products
    bias_ptr,  # [N] (read when HAS_BIAS)
    c_ptr,  # [total] = [Bt, M, N] contiguous, the output dtype
    total,
    N,
    NSPLIT,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < total
    w = w_ptr + i  # 64-bit addresses: a split's offset is a pointer step (s * total overflows int32)
    acc = tl.load(w, mask=ok, other=0.0)
    for _ in range(1, NSPLIT):  # ascending splits: one fixed order per element
        w += total
        acc = acc + tl.load(w, mask=ok, other=0.0)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(c_ptr + i, round_to(acc, c_ptr.dtype.element_ty), mask=ok)


REDUCE_BLOCK = 1024  # output elements per program of the split reduction
SMEM_BYTES = 227 * 1024  # an H100/H200 block's opt-in shared memory: the limit without a CUDA device to ask
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def check_config(
    config: tuple[int, int, int, int, int], element_size: int, device: torch.device | None = None
) -> tuple[int, int, int, int, int]:
    """Validate ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)``: positive ints, blocks powers of
    two in [16, 256] (``store.config_problem``'s rules, then the ranges), num_warps in (1, 2, 4, 8),
    num_stages in [1, 8], and the ``num_stages`` buffered A and B tiles (an estimate; Triton's own
    check at launch is exact) within the CUDA ``device``'s opt-in shared memory per block
    (``SMEM_BYTES``, Hopper's, without one) for inputs of ``element_size`` bytes."""
    ok = (
        isinstance(config, tuple)
        and len(config) == 5
        and config_problem(dict(zip(CONFIG_KEYS, config)), dict.fromkeys(CONFIG_KEYS, 1)) is None
        and all(16 <= v <= 256 for v in config[:3])
        and config[3] in (1, 2, 4, 8)
        and 1 <= config[4] <= 8
    )
    if not ok:
        raise ValueError(
            f"config={config!r}: give (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) with blocks powers "
            "of two in [16, 256], num_warps 1, 2, 4 or 8 and num_stages 1..8"
        )
    bm, bn, bk, _, stages = config
    smem = stages * (bm * bk + bk * bn) * element_size
    limit = SMEM_BYTES
    if device is not None and device.type == "cuda":
        limit = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    if smem > limit:
        raise ValueError(
            f"config={config!r}: {stages} stages of a {bm}x{bk} and a {bk}x{bn} tile take {smem} bytes of shared "
            f"memory (> {limit} on this device); use smaller blocks or fewer stages"
        )
    return config


def batch_invariant_matmul(
    a: torch.Tensor,  # [M, K] or [Bt, M, K], any strides
    b: torch.Tensor,  # [K, N] or [Bt, K, N], any strides (a weight's transpose is a view)
    bias: torch.Tensor | None = None,  # [N]
    *,
    config: tuple[int, int, int, int, int] | None = None,
    k_split: int | None = None,
) -> torch.Tensor:  # [M, N] or [Bt, M, N], contiguous, dtype of a
    """Triton ``a @ b + bias`` with one fixed tile configuration per dtype (see the module docstring):
    bit-identical rows whatever M, the batch size or the other rows hold.

    ``config`` overrides ``CONFIGS[a.dtype]`` (benchmarks compare tilings with it). ``k_split``: K in
    fixed chunks of this many (a multiple of BLOCK_K), each chunk's products summed by its own
    programs and the chunks then added in order (None: one pass over K). Any fixed configuration and
    split keeps rows batch-invariant; two of them round differently, so one caller must keep one per
    weight, never choose it by M.

    Examples
    --------
    >>> x = torch.randn(5, 64, device="cuda")                          # doctest: +SKIP
    >>> w = torch.randn(128, 64, device="cuda")                        # doctest: +SKIP
    >>> torch.equal(batch_invariant_matmul(x, w.T)[:1], batch_invariant_matmul(x[:1], w.T))  # doctest: +SKIP
    True
    """
    require_triton()
    check_tensor("a", a, dtypes=FLOAT_DTYPES, contiguous=False)
    check_tensor("b", b, dtypes=(a.dtype,), contiguous=False, device=a.device)
    if a.dim() not in (2, 3) or b.dim() not in (2, a.dim()):
        raise ValueError(
            f"a must be [M, K] or [Bt, M, K] and b [K, N] or [Bt, K, N]; got {tuple(a.shape)}, {tuple(b.shape)}"
        )
    batched = a.dim() == 3
    a3 = a if batched else a[None]
    b3 = b if b.dim() == 3 else b[None]
    bt, m, k = a3.shape
    if b3.shape[1] != k or b3.shape[0] not in (1, bt):
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} do not multiply")
    n = b3.shape[2]
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, shape=(n,), device=a.device)
    cfg = CONFIGS[a.dtype] if config is None else check_config(config, a.element_size(), a.device)
    block_m, block_n, block_k, warps, stages = cfg
    if k_split is not None and (not isinstance(k_split, int) or k_split <= 0 or k_split % block_k):
        raise ValueError(f"k_split={k_split!r} must be a positive multiple of BLOCK_K={block_k} (or None: no split)")
    nsplit = triton.cdiv(k, k_split) if k_split is not None and k > 0 else 1
    if bt * nsplit > 65535:  # CUDA's limit on the grid's third axis
        raise ValueError(f"{bt} batch items x {nsplit} K splits exceed the grid's 65535: use a larger k_split or None")
    c = torch.empty(bt, m, n, dtype=a.dtype, device=a.device)
    if c.numel():
        part = torch.empty(nsplit, bt, m, n, dtype=torch.float32, device=a.device) if nsplit > 1 else c
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), bt * nsplit)
        _bi_matmul_kernel[grid](
            a3,
            b3,
            part,
            bias if bias is not None else c,
            m,
            n,
            k,
            *a3.stride(),
            b3.stride(0) if b3.shape[0] == bt and bt > 1 else 0,
            b3.stride(1),
            b3.stride(2),
            *c.stride(),
            k_split if nsplit > 1 else k,
            nsplit,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            HAS_BIAS=bias is not None,
            INPUT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",  # tf32 is ignored for 16-bit inputs
            UPCAST=a.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
            PARTIAL=nsplit > 1,
            num_warps=warps,
            num_stages=stages,
            enable_fp_fusion=ENABLE_FP_FUSION,
        )
        if nsplit > 1:
            total = bt * m * n
            _bi_reduce_kernel[(triton.cdiv(total, REDUCE_BLOCK),)](
                part,
                bias if bias is not None else c,
                c,
                total,
                n,
                nsplit,
                BLOCK=REDUCE_BLOCK,
                HAS_BIAS=bias is not None,
                num_warps=4,
                enable_fp_fusion=ENABLE_FP_FUSION,
            )
    return c if batched else c[0]


def batch_invariant_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    *,
    config: tuple[int, int, int, int, int] | None = None,
    k_split: int | None = None,
) -> torch.Tensor:  # [..., N]
    """``F.linear`` through ``batch_invariant_matmul`` (the weight's transpose is a view, not a copy)."""
    out = batch_invariant_matmul(x.reshape(-1, x.shape[-1]), weight.t(), bias, config=config, k_split=k_split)
    return out.view(*x.shape[:-1], weight.shape[0])
