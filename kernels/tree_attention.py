"""Tree attention: query tokens attend to a cached prefix plus the tree's own tokens.

One op serves the target (prefill, plain decode, tree verify) and the drafter (catch-up,
tree levels). Per row ``b`` the cache holds a committed prefix in slots ``[0, prefix_lens[b])``
followed by a tree region of width T starting at slot ``prefix_lens[b]``. Query ``q`` sees:

    slot s < prefix_lens[b]                                   (the whole prefix), and
    slot prefix_lens[b] + t   where tree_mask[b, q, t]         (its ancestors and itself)

    out[b, q, h] = softmax_s( scale * <Q[b,q,h], K[b,s,h//G]> | visible ) @ V[b, s, h//G]

with G = Hq / Hkv query heads per KV head (GQA). The queries' own K/V must already be written
into the cache (``kernels.kv_write``). A causal mask over the tree region gives ordinary
causal attention (prefill, catch-up); a 1x1 mask gives one-token decode.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .store import tuned
from .utils import (
    ENABLE_FP_FUSION,
    check_attention_inputs,
    next_pow2,
    require_triton,
    round_to,
    tl,
    triton,
)


def tree_visibility(
    prefix_lens: torch.Tensor,  # [B] int64
    tree_mask: torch.Tensor,  # [B, Q, T] bool
    kv_len: int,
) -> torch.Tensor:  # [B, Q, kv_len] bool
    """Which cache slots each query may attend to (the mask stated in the module docstring)."""
    T = tree_mask.shape[-1]
    rel = torch.arange(kv_len, device=prefix_lens.device)[None, :] - prefix_lens[:, None]  # [B, S]
    in_prefix = rel < 0
    in_tree = (rel >= 0) & (rel < T)
    idx = rel.clamp(0, T - 1)[:, None, :].expand(-1, tree_mask.shape[1], -1)  # [B, Q, S]
    tree_vis = torch.gather(tree_mask, 2, idx) & in_tree[:, None, :]
    return in_prefix[:, None, :] | tree_vis


def tree_attention_reference(
    q: torch.Tensor,  # [B, Q, Hq, D]
    k_cache: torch.Tensor,  # [B_max, S, Hkv, D] (one layer)
    v_cache: torch.Tensor,  # [B_max, S, Hkv, D]
    prefix_lens: torch.Tensor,  # [B] int64
    tree_mask: torch.Tensor,  # [B, Q, T] bool
    scale: float,
    kv_len: int | None = None,
) -> torch.Tensor:  # [B, Q, Hq, D]
    """Attention of each query over its visible slots (see module docstring).

    ``kv_len`` bounds the slots read (a host-known upper bound on ``prefix_lens + T``); it is
    a speed hint only and never changes the result.
    """
    batch, nq, hq, d = q.shape
    hkv = k_cache.shape[2]
    S = k_cache.shape[1] if kv_len is None else kv_len
    k = k_cache[:batch, :S].transpose(1, 2)  # [B, Hkv, S, D]
    v = v_cache[:batch, :S].transpose(1, 2)
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    vis = tree_visibility(prefix_lens, tree_mask, S)[:, None]  # [B, 1, Q, S]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.to(q.dtype), v.to(q.dtype), attn_mask=vis, scale=scale)
    return out.transpose(1, 2)


# --------------------------------------------------------------------------------------------
# Triton kernels and launcher
#
# Flash-decoding style, in two launches:
#   1. partial: grid (Hkv * m_tiles, 1 + n_splits, B). A program takes BLOCK_M rows of
#      (query, head-in-group) pairs that share one KV head (GQA packed into the M dimension),
#      and one key range: split 0 is the tree region [P, P + T) under the tree mask, split
#      i >= 1 is the prefix range [(i-1)*SPLIT, i*SPLIT) ∩ [0, P). It runs an online softmax
#      over BLOCK_N-key blocks and writes the unnormalised accumulator, the running max (log2
#      units) and the running sum.
#   2. merge: one program per (query, head) folds the prefix splits in ascending order, then
#      the tree split, and divides.
# Row r = q * G + g always sits at tile r // BLOCK_M, lane r % BLOCK_M, split boundaries are
# multiples of SPLIT in absolute key position, and the merge order is fixed: a query's result
# depends on its own q, mask row, prefix length and the cache only, never on B, Q, T or the
# ``kv_len`` hint (empty splits are never merged). BLOCK_M/BLOCK_N/SPLIT are fixed per head_dim
# (``attention_config``), never per call.
# --------------------------------------------------------------------------------------------
SPLIT_KV = 2048  # prefix keys per flash-decoding split (fixed: part of the reduction order)
_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """fp32-accumulated ``a @ b``. ``UPCAST`` (interpreter only: its bf16 dot reads raw bits)
    multiplies the exactly widened fp32 operands instead, which is what the MMA computes."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _softmax_block(s, v, m_i, l_i, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One key block of an online softmax: scores ``s`` [M, N] (log2 units, -inf where not visible) and
    values ``v`` [N, D] folded into the running max ``m_i``, sum ``l_i`` and accumulator ``acc``."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(round_to(p, v.dtype), v, PRECISION, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _merge_split(acc_ptr, ml_ptr, slot, m, l, acc, d, d_ok, D: tl.constexpr):
    """Fold split ``slot``'s partials (its max, sum and unnormalised accumulator) into the running
    ``m``, ``l`` and ``acc`` of a merge."""
    m_s = tl.load(ml_ptr + slot * 2)
    l_s = tl.load(ml_ptr + slot * 2 + 1)
    a_s = tl.load(acc_ptr + slot * D + d, mask=d_ok, other=0.0)
    m_new = tl.maximum(m, m_s)
    alpha = tl.math.exp2(m - m_new)
    beta = tl.math.exp2(m_s - m_new)
    return m_new, l * alpha + l_s * beta, acc * alpha + a_s * beta


@triton.jit(do_not_specialize=["Q", "T", "kv_len", "NS"])
def _tree_attn_partial_kernel(
    q_ptr,  # [B, Q, HQ, D]: strides (stride_qb, stride_qq, stride_qh, 1)
    k_ptr,  # [B_max, S, HKV, D]: rows at stride_kb, slots at stride_ks, (HKV, D) contiguous
    v_ptr,  # [B_max, S, HKV, D]
    prefix_ptr,  # [B] int64
    mask_ptr,  # [B, Q, T] bool, strides (stride_mb, stride_mq, stride_mt) (an expanded mask is fine)
    acc_ptr,  # [B, Q, HQ, NS, D] fp32 out: unnormalised sum p @ v per split
    ml_ptr,  # [B, Q, HQ, NS, 2] fp32 out: (running max of scale*log2e*qk, running sum of p)
    stride_qb,
    stride_qq,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    stride_mb,
    stride_mq,
    stride_mt,
    Q,
    T,
    kv_len,
    NS,
    qk_scale,  # scale * log2(e)
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    NEG: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    G: tl.constexpr = HQ // HKV
    n_mtiles = tl.cdiv(Q * G, BLOCK_M)
    hkv = tl.program_id(0) // n_mtiles
    mtile = tl.program_id(0) % n_mtiles
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)

    rows = mtile * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // G
    h = hkv * G + rows % G
    row_ok = qi < Q
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    qrow = (b * Q + qi) * HQ + h  # [BLOCK_M] row of the partials in [B*Q*HQ]
    q_off = b * stride_qb + qi * stride_qq + h * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    prefix = tl.load(prefix_ptr + b)
    is_tree = split == 0
    # key range [lo, hi): the tree region, or one SPLIT-aligned piece of the prefix
    lo = tl.where(is_tree, prefix, (split - 1) * SPLIT)
    hi = tl.where(is_tree, tl.minimum(prefix + T, kv_len), tl.minimum(tl.minimum(split * SPLIT, prefix), kv_len))

    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    tree_hi = tl.where(is_tree, hi, 0)  # keys below tree_hi read the tree mask (none for a prefix split)
    k_base = k_ptr + b * stride_kb + hkv * D
    v_base = v_ptr + b * stride_vb + hkv * D
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + n[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N]
        vis = row_ok[:, None] & n_ok[None, :]
        tree_bit = tl.load(
            mask_ptr + b * stride_mb + qi[:, None] * stride_mq + (n - prefix)[None, :] * stride_mt,
            mask=vis & (n < tree_hi)[None, :],
            other=1,
        )
        vis = vis & (tree_bit != 0)
        s = tl.where(vis, s, float("-inf"))
        v = tl.load(v_base + n[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        m_i, l_i, acc = _softmax_block(s, v, m_i, l_i, acc, DOT_PRECISION, DOT_UPCAST)

    slot = qrow.to(tl.int64) * NS + split
    # empty prefix splits are never merged: skip their store (a scalar condition folded into
    # an index comparison, which the interpreter's masked store accepts)
    keep = qi < tl.where(is_tree | (hi > lo), Q, 0)
    tl.store(acc_ptr + slot[:, None] * D + d[None, :], acc, mask=keep[:, None] & d_ok[None, :])
    tl.store(ml_ptr + slot * 2, m_i, mask=keep)
    tl.store(ml_ptr + slot * 2 + 1, l_i, mask=keep)


@triton.jit(do_not_specialize=["kv_len", "NS"])
def _tree_attn_merge_kernel(
    acc_ptr,  # [B, Q, HQ, NS, D] fp32
    ml_ptr,  # [B, Q, HQ, NS, 2] fp32
    prefix_ptr,  # [B] int64
    out_ptr,  # [B, Q, HQ, D] contiguous, dtype of q
    QH,  # Q * HQ
    kv_len,
    NS,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    NEG: tl.constexpr,
):
    b = tl.program_id(1).to(tl.int64)
    row = b * QH + tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    n_prefix_splits = tl.cdiv(tl.minimum(tl.load(prefix_ptr + b), kv_len), SPLIT)
    m = tl.full([], NEG, tl.float32)
    l = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    # prefix splits 1..n in ascending key order, then the tree split 0
    for i in range(0, n_prefix_splits + 1):
        split = tl.where(i < n_prefix_splits, i + 1, 0)
        m, l, acc = _merge_split(acc_ptr, ml_ptr, row * NS + split, m, l, acc, d, d_ok, D)
    out = tl.where(l > 0, acc / tl.where(l > 0, l, 1.0), 0.0)  # no visible key: 0, like SDPA
    tl.store(out_ptr + row * D + d, round_to(out, out_ptr.dtype.element_ty), mask=d_ok)


def attention_config(head_dim: int, dtype: torch.dtype, device: torch.device | None = None) -> dict:
    """Tiles, warps, stages and the prefix split per head_dim (never per B, Q or context length):
    the tuned entry for this GPU/dtype (``kernels.store``) when there is a valid one, else the heuristic."""
    default = dict(
        BLOCK_M=64,
        BLOCK_N=64 if max(next_pow2(head_dim), 16) <= 128 else 32,
        num_warps=4,
        num_stages=2,
        split_kv=SPLIT_KV,
    )
    cfg = tuned("tree_attention", head_dim, default, dtype=dtype, device=device)
    return cfg if cfg["split_kv"] % cfg["BLOCK_N"] == 0 and min(cfg["BLOCK_M"], cfg["BLOCK_N"]) >= 16 else default


def _attention_constexprs(head_dim: int, dtype: torch.dtype, device: torch.device | None = None) -> dict:
    """The kernels' tile and dot constexprs from head_dim/dtype only (never from B, Q or the context
    length): BLOCK_D, the tuned BLOCK_M/BLOCK_N, the dot precision and the interpreter's bf16 upcast."""
    block_d = max(next_pow2(head_dim), 16)
    t = attention_config(head_dim, dtype, device)
    return dict(
        BLOCK_D=block_d,
        BLOCK_M=t["BLOCK_M"],
        BLOCK_N=t["BLOCK_N"],
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",  # tf32 is ignored for 16-bit inputs
        DOT_UPCAST=dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
    )


def tree_attention(
    q: torch.Tensor,  # [B, Q, Hq, D]
    k_cache: torch.Tensor,  # [B_max, S, Hkv, D] (one layer)
    v_cache: torch.Tensor,  # [B_max, S, Hkv, D]
    prefix_lens: torch.Tensor,  # [B] int64
    tree_mask: torch.Tensor,  # [B, Q, T] bool
    scale: float,
    kv_len: int | None = None,
    *,
    split_kv: int | None = None,
) -> torch.Tensor:  # [B, Q, Hq, D]
    """Triton twin of ``tree_attention_reference``.

    ``kv_len`` (a host int) only bounds the grid; visibility is clipped to it exactly as in the
    reference. ``split_kv`` is the fixed prefix split (a multiple of the key block); results for
    a given split size never depend on the batch, the number of queries or ``kv_len``.
    """
    require_triton()
    B, Q, hq, hkv, d = check_attention_inputs(q, k_cache, v_cache, prefix_lens, tree_mask)
    S = k_cache.shape[1]
    T = tree_mask.shape[2]
    kv_len = S if kv_len is None else min(int(kv_len), S)
    cfg = _attention_constexprs(d, q.dtype, q.device)
    launch = attention_config(d, q.dtype, q.device)
    split_kv = launch["split_kv"] if split_kv is None else split_kv  # default: SPLIT_KV or the tuned split
    if split_kv % cfg["BLOCK_N"]:
        raise ValueError(f"split_kv={split_kv} must be a multiple of the key block {cfg['BLOCK_N']}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if B * Q * hq == 0:
        return out
    n_splits = triton.cdiv(kv_len, split_kv) if kv_len > 0 else 0
    ns = 1 + n_splits
    acc = torch.empty((B, Q, hq, ns, d), dtype=torch.float32, device=q.device)
    ml = torch.empty((B, Q, hq, ns, 2), dtype=torch.float32, device=q.device)
    n_mtiles = triton.cdiv(Q * (hq // hkv), cfg["BLOCK_M"])
    neg = -1.0e30  # finite "minus infinity" for running maxima: exp2(NEG - NEG) = 1, never NaN
    _tree_attn_partial_kernel[(hkv * n_mtiles, ns, B)](
        q, k_cache, v_cache, prefix_lens, tree_mask, acc, ml,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        tree_mask.stride(0), tree_mask.stride(1), tree_mask.stride(2),
        Q, T, kv_len, ns, float(scale) * _LOG2E,
        HQ=hq, HKV=hkv, D=d, SPLIT=split_kv, NEG=neg, **cfg,
        num_warps=launch["num_warps"], num_stages=launch["num_stages"], enable_fp_fusion=ENABLE_FP_FUSION,
    )  # fmt: skip
    _tree_attn_merge_kernel[(Q * hq, B)](
        acc, ml, prefix_lens, out, Q * hq, kv_len, ns,
        D=d, BLOCK_D=cfg["BLOCK_D"], SPLIT=split_kv, NEG=neg,
        num_warps=1 if cfg["BLOCK_D"] <= 128 else 2, enable_fp_fusion=ENABLE_FP_FUSION,
    )  # fmt: skip
    return out
