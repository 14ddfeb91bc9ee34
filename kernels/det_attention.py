"""Layout-invariant tree attention: deterministic mode's attention on a GPU (issue 16).

The math is ``kernels.tree_attention``'s (``tree_attention_reference``): query i of row b attends to
the committed prefix, slots ``[0, prefix_lens[b])``, and to the tree slots ``prefix_lens[b] + t`` with
``tree_mask[b, i, t]``. What differs is the order of the sums. Each query reads its *canonical
sequence*, positions ``0..n-1`` (n = prefix + visible tree slots):

    position p < prefix       ->  slot p
    position prefix + j       ->  slot prefix + (the j-th visible tree slot, ascending)

in blocks of ``BLOCK_N`` positions anchored at position 0, grouped into splits of ``SPLIT`` positions
(an online softmax inside a split, exp2 of ``scale * log2(e) * q.k``), the splits then merged in
ascending order. One program holds one query's G = Hq / Hkv heads (its own tile, lanes 0..G-1), so
nothing it computes depends on the other queries, the batch, the tree's width T, the ``kv_len``
bound or where in the cache the keys sit: a token verified as a tree node gets the bits it gets when
decoded alone after its ancestors were committed (they then sit in the prefix), and a prompt token
(``det_causal_attention``, query p over positions 0..p) the bits of a decode step at p. That is what
deterministic mode needs of attention (``runtime/deterministic.py``); ``kernels.tree_attention``
is batch-invariant too, but it reduces the tree region apart from the prefix, so a token's bits
change when its ancestors move from the tree into the prefix.

Cost against ``tree_attention``: a verify's queries each read the whole prefix (no tile shares keys
among queries), which matters for wide trees over long contexts, and a prompt's queries read its K/V
once each (O(P^2) reads, mostly from L2; the partials' buffer is bounded by running the queries in
chunks, ``PARTIALS_BYTES``). The tile shapes, split and warps are fixed per head_dim (never tuned,
never per call), as the batch-invariant matmul's are.
"""

from __future__ import annotations

import os

import torch

from .tree_attention import _LOG2E, _dot, _merge_split, _softmax_block, tree_attention_reference
from .utils import (
    ENABLE_FP_FUSION,
    check_attention_inputs,
    next_pow2,
    require_triton,
    round_to,
    tl,
    triton,
)

SPLIT = 2048  # canonical positions per split (fixed: part of the reduction order)
NUM_WARPS = 4
NUM_STAGES = 2
PARTIALS_BYTES = 1 << 28  # a causal call runs its queries in chunks whose fp32 partials fit in this
_NEG = -1.0e30  # finite "minus infinity" for running maxima: exp2(NEG - NEG) = 1, never NaN


def det_attention_reference(
    q: torch.Tensor,  # [B, Q, Hq, D]
    k_cache: torch.Tensor,  # [B_max, S, Hkv, D]
    v_cache: torch.Tensor,  # [B_max, S, Hkv, D]
    prefix_lens: torch.Tensor,  # [B] int64
    tree_mask: torch.Tensor,  # [B, Q, T] bool
    scale: float,
    kv_len: int | None = None,
) -> torch.Tensor:  # [B, Q, Hq, D]
    """The same attention as ``det_tree_attention`` in PyTorch (``tree_attention_reference``): equal
    within rounding, not bit for bit (the kernel's order of sums is its own)."""
    return tree_attention_reference(q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len)


def tree_order(
    prefix_lens: torch.Tensor,  # [B] int64
    tree_mask: torch.Tensor,  # [B, Q, T] bool
    kv_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [B] int32, [B, Q, max(T, 1)] int32, [B, Q] int32
    """Each query's canonical sequence in the kernel's terms: the prefix length (clipped to ``kv_len``),
    its visible tree slots as absolute slot numbers in ascending order (then zeros), and how many.
    Tensor ops only (no host read): computed once per forward and shared by every layer."""
    B, Q, T = tree_mask.shape
    if T == 0:  # no tree slots: one never-visible column keeps the kernel's slot table non-empty
        tree_mask, T = tree_mask.new_zeros(B, Q, 1), 1
    ar = torch.arange(T, device=tree_mask.device)
    pre = prefix_lens.clamp(max=kv_len)  # [B]
    vis = tree_mask & (prefix_lens[:, None, None] + ar < kv_len)  # a tree slot past kv_len is not read
    counts = vis.sum(-1)  # [B, Q]
    order = torch.sort((~vis).to(torch.int8), dim=-1, stable=True).indices  # visible slots first, ascending
    slots = torch.where(ar < counts[..., None], prefix_lens[:, None, None] + order, 0)
    return pre.to(torch.int32), slots.to(torch.int32).contiguous(), counts.to(torch.int32).contiguous()


@triton.jit(do_not_specialize=["Q", "T", "NS", "q_offset", "causal"])
def _det_attn_partial_kernel(
    q_ptr,  # [B, Q, HQ, D]: strides (stride_qb, stride_qq, stride_qh, 1)
    k_ptr,  # [B_max, S, HKV, D]: rows at stride_kb, slots at stride_ks, (HKV, D) contiguous
    v_ptr,  # [B_max, S, HKV, D]
    pre_ptr,  # [B] int32 prefix length (not read when causal)
    slots_ptr,  # [B, Q, T] int32 the visible tree slots, ascending (not read when causal)
    counts_ptr,  # [B, Q] int32 how many (not read when causal)
    acc_ptr,  # [B, Q, HQ, NS, D] fp32 out: unnormalised sum p @ v per split
    ml_ptr,  # [B, Q, HQ, NS, 2] fp32 out: (running max of scale*log2e*qk, running sum of p)
    stride_qb,
    stride_qq,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    Q,
    T,
    NS,
    q_offset,  # causal: query i sits at position q_offset + i and reads positions 0..q_offset + i
    causal,  # 1: a prompt's causal queries, 0: a tree's (a runtime flag: both run one compiled kernel)
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
    bq = tl.program_id(0).to(tl.int64)  # b * Q + i
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    b = bq // Q
    qi = bq % Q

    g = tl.arange(0, BLOCK_M)  # lane g: head hkv * G + g of this query, always
    row_ok = g < G
    h = hkv * G + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_off = b * stride_qb + qi * stride_qq + h * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    tree = causal == 0
    pre = tl.where(tree, tl.load(pre_ptr + b, mask=tree, other=0).to(tl.int64), q_offset + qi + 1)
    n = pre + tl.load(counts_ptr + bq, mask=tree, other=0).to(tl.int64)
    lo = split * SPLIT
    hi = tl.minimum(n, lo + SPLIT)

    m_i = tl.full([BLOCK_M], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_ptr + b * stride_kb + hkv * D
    v_base = v_ptr + b * stride_vb + hkv * D
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)  # canonical positions
        t_ok = t < hi
        in_pre = t < pre
        tree_slot = tl.load(slots_ptr + bq * T + (t - pre), mask=t_ok & ~in_pre, other=0)
        slot = tl.where(in_pre, t, tree_slot).to(tl.int64)
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N]
        s = tl.where(row_ok[:, None] & t_ok[None, :], s, float("-inf"))
        v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        m_i, l_i, acc = _softmax_block(s, v, m_i, l_i, acc, DOT_PRECISION, DOT_UPCAST)

    row = (bq * HQ + h) * NS + split  # [BLOCK_M] this split's slot of each head's partials
    # a split past the sequence is never merged: no store (a graph's kv_len bound gives many); the scalar
    # condition folded into a lane comparison, which the interpreter's masked store accepts
    keep = g < tl.where(lo < n, G, 0)
    tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=keep[:, None] & d_ok[None, :])
    tl.store(ml_ptr + row * 2, m_i, mask=keep)
    tl.store(ml_ptr + row * 2 + 1, l_i, mask=keep)


@triton.jit(do_not_specialize=["Q", "NS", "q_offset", "causal"])
def _det_attn_merge_kernel(
    acc_ptr,  # [B, Q, HQ, NS, D] fp32
    ml_ptr,  # [B, Q, HQ, NS, 2] fp32
    pre_ptr,  # [B] int32 (not read when causal)
    counts_ptr,  # [B, Q] int32 (not read when causal)
    out_ptr,  # [B, Q, HQ, D] contiguous, dtype of q
    Q,
    NS,
    q_offset,
    causal,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    NEG: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # (b * Q + i) * HQ + h
    bq = row // HQ
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    tree = causal == 0
    pre = tl.where(tree, tl.load(pre_ptr + bq // Q, mask=tree, other=0).to(tl.int64), q_offset + bq % Q + 1)
    n = pre + tl.load(counts_ptr + bq, mask=tree, other=0).to(tl.int64)
    m = tl.full([], NEG, tl.float32)
    l = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for split in range(0, tl.minimum(tl.cdiv(n, SPLIT), NS)):  # the splits that hold positions, ascending
        m, l, acc = _merge_split(acc_ptr, ml_ptr, row * NS + split, m, l, acc, d, d_ok, D)
    out = tl.where(l > 0, acc / tl.where(l > 0, l, 1.0), 0.0)  # no visible key: 0, like SDPA
    tl.store(out_ptr + row * D + d, round_to(out, out_ptr.dtype.element_ty), mask=d_ok)


def det_attention_constexprs(head_dim: int, group: int, dtype: torch.dtype) -> dict:
    """The kernels' tiles from head_dim, the GQA group and dtype only (never from B, Q, T or the
    context length; never tuned): one query's heads in a tile of at least 16 lanes (the MMA's
    smallest M), 64 positions a block (32 above head_dim 128)."""
    block_d = max(next_pow2(head_dim), 16)
    return dict(
        BLOCK_D=block_d,
        BLOCK_M=max(next_pow2(group), 16),
        BLOCK_N=64 if block_d <= 128 else 32,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",  # tf32 is ignored for 16-bit inputs
        DOT_UPCAST=dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
    )


def _launch(q, k, v, pre, slots, counts, scale, ns, q_offset, causal) -> torch.Tensor:
    B, Q, hq, hkv, d = q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3]
    if hq // hkv > 128:
        raise ValueError(f"{hq // hkv} query heads per KV head: at most 128 (one query's heads share a tile)")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if B * Q * hq == 0:
        return out
    cfg = det_attention_constexprs(d, hq // hkv, q.dtype)
    ns = max(ns, 1)
    acc = torch.empty((B, Q, hq, ns, d), dtype=torch.float32, device=q.device)
    ml = torch.empty((B, Q, hq, ns, 2), dtype=torch.float32, device=q.device)
    T = slots.shape[-1]
    _det_attn_partial_kernel[(B * Q, hkv, ns)](
        q, k, v, pre, slots, counts, acc, ml,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        Q, T, ns, q_offset, int(causal), float(scale) * _LOG2E,
        HQ=hq, HKV=hkv, D=d, SPLIT=SPLIT, NEG=_NEG, **cfg,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, enable_fp_fusion=ENABLE_FP_FUSION,
    )  # fmt: skip
    _det_attn_merge_kernel[(B * Q * hq,)](
        acc, ml, pre, counts, out, Q, ns, q_offset, int(causal),
        HQ=hq, D=d, BLOCK_D=cfg["BLOCK_D"], SPLIT=SPLIT, NEG=_NEG,
        num_warps=1 if cfg["BLOCK_D"] <= 128 else 2, enable_fp_fusion=ENABLE_FP_FUSION,
    )  # fmt: skip
    return out


def det_tree_attention(
    q: torch.Tensor,  # [B, Q, Hq, D]
    k_cache: torch.Tensor,  # [B_max, S, Hkv, D] (one layer)
    v_cache: torch.Tensor,  # [B_max, S, Hkv, D]
    prefix_lens: torch.Tensor,  # [B] int64
    tree_mask: torch.Tensor,  # [B, Q, T] bool
    scale: float,
    kv_len: int | None = None,
    *,
    order: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # [B, Q, Hq, D]
    """Attention of each query over its canonical sequence (module docstring): the values of
    ``det_attention_reference``, and a query's bits depend on its q and the keys and values of its
    sequence only.

    ``kv_len`` (a host int) bounds the slots read, as in the reference, and sizes the grid.
    ``order``: ``tree_order(prefix_lens, tree_mask, kv_len)`` when the caller shares it among layers.

    Example
    -------
    >>> q = torch.randn(1, 2, 4, 16); kc = torch.randn(1, 8, 2, 16); vc = torch.randn(1, 8, 2, 16)  # doctest: +SKIP
    >>> mask = torch.tensor([[[True, False], [True, True]]])                                        # doctest: +SKIP
    >>> out = det_tree_attention(q, kc, vc, torch.tensor([5]), mask, 0.25)                          # doctest: +SKIP
    """
    require_triton()
    check_attention_inputs(q, k_cache, v_cache, prefix_lens, tree_mask)
    S = k_cache.shape[1]
    kv_len = S if kv_len is None else min(int(kv_len), S)
    if order is None:
        order = tree_order(prefix_lens, tree_mask, kv_len)
    pre, slots, counts = order
    B, Q = q.shape[:2]
    if pre.shape != (B,) or counts.shape != (B, Q) or slots.shape[:2] != (B, Q) or slots.dim() != 3:
        raise ValueError(
            f"order: ({tuple(pre.shape)}, {tuple(slots.shape)}, {tuple(counts.shape)}) is not tree_order's for "
            f"{B} rows of {Q} queries; pass tree_order(prefix_lens, tree_mask, kv_len) of this call"
        )
    if {pre.dtype, slots.dtype, counts.dtype} != {torch.int32} or not (
        slots.is_contiguous() and counts.is_contiguous()
    ):
        raise ValueError("order: tree_order's contiguous int32 tensors expected")
    return _launch(q, k_cache, v_cache, pre, slots, counts, scale, triton.cdiv(kv_len, SPLIT), 0, False)


def det_causal_attention(
    q: torch.Tensor,  # [B, P, Hq, D]
    k: torch.Tensor,  # [B, >= q_offset + P, Hkv, D]: the keys of positions 0.. (a prompt's, or a cache)
    v: torch.Tensor,  # [B, >= q_offset + P, Hkv, D]
    scale: float,
    q_offset: int = 0,
) -> torch.Tensor:  # [B, P, Hq, D]
    """Causal attention, query i at position ``q_offset + i`` over positions ``0..q_offset + i``, as the
    canonical sequence of ``det_tree_attention``: a prompt token gets the bits a decode step at its
    position gets."""
    require_triton()
    check_attention_inputs(q, k, v, names=("k", "v"))
    if isinstance(q_offset, bool) or not isinstance(q_offset, int) or q_offset < 0:
        raise ValueError(f"q_offset={q_offset!r} must be an int >= 0 (the position of the first query)")
    B, P, hq, d = q.shape
    if k.shape[1] < q_offset + P:
        raise ValueError(f"k holds {k.shape[1]} positions; queries reach position {q_offset + P - 1}")
    dummy_pre = torch.zeros(1, dtype=torch.int32, device=q.device)
    dummy_slots = torch.zeros(1, 1, 1, dtype=torch.int32, device=q.device)
    # queries in chunks (each query's result is its own program's: chunking changes no bit) so that
    # the fp32 partials, which grow with the chunk and with its last position's splits, stay bounded
    per_query = B * hq * (d + 2) * 4 * triton.cdiv(q_offset + P, SPLIT)
    step = max(1, PARTIALS_BYTES // max(per_query, 1))
    outs = [
        _launch(q[:, i : i + step], k, v, dummy_pre, dummy_slots, dummy_pre, scale, ns, q_offset + i, True)
        for i in range(0, max(P, 1), step)
        for ns in [triton.cdiv(q_offset + min(P, i + step), SPLIT)]
    ]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
