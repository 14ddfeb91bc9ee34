"""The decode round's index bookkeeping on the CPU: greedy verification, the draft tree's node
arrays, prompt lookup, the lookup branch's graft and the K/V compaction, one C call each
(``kernels/cpu/tree_ops.c``).

Math: that of the references, which stay the specification and run wherever these do not: each
function here returns None (``kv_compact``: False) on CUDA tensors, under a tracer (a compiled round),
without the native operator, or for inputs it does not take, and its caller runs the reference; the
callers also keep the references under ``cpu_linear="torch"`` (``TorchOps.cpu_index``):

    verify_greedy   kernels/verify.py      verify_greedy_reference   accepted path, count, emitted tokens
    build_tree      runtime/tree.py        build_tree                parents, depths, ancestor mask
    ngram_lookup    runtime/ngram.py       ngram_lookup              the prompt-lookup chain and its validity
    graft_chain     runtime/ngram.py       graft_chain               the chain grafted below the root
    kv_compact      kernels/kv_compact.py  kv_compact_reference      the accepted path's K/V moved in place
    row_random      runtime/sampling.py    RowRandom.draw            a sampled round's uniforms and Exp(1) noise
    verify_chain    kernels/verify_chain.py verify_chain_reference   a sampled chain's accepted count and tokens
    argmax          torch.argmax(x, -1)                               the verify's greedy token per node

Integers, booleans and copies (``argmax``: comparisons only, a bfloat16 widened exactly; ``verify_chain``: the
reference's float64 coin test, float32 residual and division, first-maximum argmax), so the C results equal
the references' exactly on the inputs the decoder passes (tested with hypothesis in
``tests/test_cpu_tree.py``); only the cost changes. Each reference is fixed-shape tensor work so that CUDA
graphs and compiled rounds can take it, which on a CPU costs 30-130 small PyTorch ops: on the demo pair an
eager default round spent 1.5 of its 9.7 ms in these five (2026-12-04). Where the decoder cannot go, they
differ only in how they fail: the graft of a tree whose root is off the chain's path (the reference raises,
the C result is clamped), a compaction path not starting at the root or an idle row starting outside the cache
(the reference's order is undefined or it raises; the C operator moves only the path); a negative chain token
(the reference's indexing wraps it, the C operator raises).
"""

from __future__ import annotations

import torch

from . import cpu_linear as _lib
from .cpu_rope import _tracing


def _native(*tensors: torch.Tensor) -> bool:
    """Whether this call runs the C operator: eager, on CPU tensors, where the operator built."""
    return all(t.device.type == "cpu" for t in tensors) and not _tracing(tensors[0]) and _lib._native_ready()


def verify_greedy(
    tokens: torch.Tensor,  # [B, N] int64, node 0 = root
    parents: torch.Tensor,  # [B, N] int64, -1 = root / padding
    target_argmax: torch.Tensor,  # [B, N] int64
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:  # nodes [B, D+1], num [B], emitted [B, D+1]
    """``kernels.verify.verify_greedy_reference``, exactly; None where the C operator does not run.

    Example
    -------
    >>> tok, par = torch.tensor([[5, 7, 9]]), torch.tensor([[-1, 0, 1]])
    >>> verify_greedy(tok, par, torch.tensor([[7, 9, 3]]), 2)[2]  # doctest: +SKIP
    tensor([[7, 9, 3]])
    """
    if _native(tokens, parents, target_argmax) and all(
        t.dtype == torch.int64 for t in (tokens, parents, target_argmax)
    ):
        return torch.ops.tritonspec_cpu.verify_greedy(tokens, parents, target_argmax, int(max_depth))
    return None


def build_tree(
    keep: torch.Tensor,  # [B, N-1] kept candidate ids, ascending
    cand_parent: torch.Tensor,  # [B, C] parent candidate id, -1 = root
    cand_depth: torch.Tensor,  # [C] depth of each candidate (1-based)
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:  # parents [B, N], depth [B, N], mask [B, N, N]
    """``runtime.tree.build_tree``, exactly; None where the C operator does not run."""
    if _native(keep, cand_parent, cand_depth) and all(t.dtype == torch.int64 for t in (keep, cand_parent, cand_depth)):
        return torch.ops.tritonspec_cpu.build_tree(keep, cand_parent, cand_depth, int(max_depth))
    return None


def ngram_lookup(
    hist: torch.Tensor,  # [B, S] int64 tokens by position, the root at L
    L: torch.Tensor,  # [B] int64
    num_tokens: int,
    n_max: int,
    n_min: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:  # chain [B, M], valid [B, M] bool
    """``runtime.ngram.ngram_lookup``, exactly; None where the C operator does not run."""
    if (
        _native(hist, L)
        and hist.dtype == torch.int64
        and L.dtype == torch.int64
        and min(num_tokens, n_max, hist.shape[-1]) >= 1
    ):
        return torch.ops.tritonspec_cpu.ngram_lookup(hist, L, int(num_tokens), int(n_max), int(n_min))
    return None


def graft_chain(
    tokens: torch.Tensor,  # [B, N] int64
    parents: torch.Tensor,  # [B, N] int64
    depth: torch.Tensor,  # [B, N] int64
    mask: torch.Tensor,  # [B, N, N] bool
    chain: torch.Tensor,  # [B, M] int64
    valid: torch.Tensor,  # [B, M] bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``runtime.ngram.graft_chain``, exactly: ``(tokens, parents, depth, mask, added)``; None where the
    C operator does not run."""
    ints = (tokens, parents, depth, chain)
    if (
        _native(*ints, mask, valid)
        and all(t.dtype == torch.int64 for t in ints)
        and mask.dtype == torch.bool
        and valid.dtype == torch.bool
        and chain.shape[-1] >= 1
    ):
        return torch.ops.tritonspec_cpu.graft_chain(tokens, parents, depth, mask, chain, valid)
    return None


def kv_compact(
    k_cache: torch.Tensor,  # [L, B_max, S, Hkv, D]
    v_cache: torch.Tensor,  # [L, B_max, S, Hkv, D]
    start: torch.Tensor,  # [B] int64, slot of the tree root per row
    nodes: torch.Tensor,  # [B, W] int64, accepted node ids (root first), -1 = none
) -> bool:
    """``kernels.kv_compact.kv_compact_reference`` in place, exactly; False (nothing done) where the C
    operator does not run."""
    if (
        _native(k_cache, v_cache, start, nodes)
        and start.dtype == torch.int64
        and nodes.dtype == torch.int64
        and k_cache.dim() >= 4
        and k_cache.shape == v_cache.shape
        and k_cache.dtype == v_cache.dtype
        and all(_slots_contiguous(c) for c in (k_cache, v_cache))
    ):
        torch.ops.tritonspec_cpu.kv_compact(k_cache, v_cache, start, nodes)
        return True
    return False


def commit_history(
    hist: torch.Tensor,  # [>= B, S] int64, written: the token at each position
    L: torch.Tensor,  # [B] int64, the committed lengths before the commit
    root: torch.Tensor,  # [B] int64, the round's root tokens
    emitted: torch.Tensor,  # [B, W] int64, the emitted tokens (-1 past the accepted path)
    nodes: torch.Tensor,  # [B, Wn] int64, the accepted node ids (-1 past the path)
    num: torch.Tensor,  # [B] int64, accepted draft tokens
    out: torch.Tensor,  # [>= B, width] int64, its last column written when n_tree > 0
    n_tree: int,  # the shape's drafter nodes (the lookup branch's ids follow), 0: no drafted count
) -> bool:
    """``Decoder.commit``'s speculative bookkeeping in place, the integers of its PyTorch ops
    (``runtime/decode.py`` ``_commit_history``): the token history from position ``L`` (the root, then the emitted
    tokens, clamped to the last slot) and, with ``n_tree``, each row's accepted drafter nodes in ``out[:, -1]`` (-1:
    the lookup branch went further). False (nothing done) where the C operator does not run."""
    tensors = (hist, L, root, emitted, nodes, num, out)
    strided = hist.dim() == 2 and out.dim() == 2 and hist.stride(1) == 1 and out.stride(1) == 1
    if _native(*tensors) and all(t.dtype == torch.int64 for t in tensors) and strided:
        torch.ops.tritonspec_cpu.commit_history(hist, L, root, emitted, nodes, num, out, int(n_tree))
        return True
    return False


def _slots_contiguous(cache: torch.Tensor) -> bool:
    """Every slot's values contiguous (the C operator copies each slot as one block)."""
    row = 1
    for d in range(cache.dim() - 1, 2, -1):
        if cache.stride(d) != row:
            return False
        row *= cache.shape[d]
    return cache.stride(2) == row


def row_random(
    key: torch.Tensor,  # [B] int64 in [0, 2^32)
    counter: torch.Tensor,  # [B] int64, advanced by 1 in place
    n: int,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:  # (uniforms [B, n], exp_noise [B, vocab]) float32
    """``runtime.sampling.RowRandom.draw``'s round, exactly: ``RowRandom.hashes``' words (in uint32 arithmetic) as
    uniforms ``(h >> 8) 2^-24`` and Exp(1) noise ``max(float32(-log((h + 0.5) 2^-32)), tiny)`` (the float64 log by
    ATen on the tensor the Python draw builds, the rest exact IEEE operations), ``counter += 1``; one call instead
    of ~60 int64 tensor ops for the words and ~12 for the rest. None where the C operator does not run (the counter
    untouched)."""
    if _native(key, counter) and key.dtype == torch.int64 and counter.dtype == torch.int64:
        return torch.ops.tritonspec_cpu.row_random(key, counter, int(n), int(vocab))
    return None


def verify_chain(
    tokens: torch.Tensor,  # [B, N] int64, node 0 = root
    probs: torch.Tensor,  # [B, N, V] float32
    draft_probs: torch.Tensor,  # [B, N-1, V] float32
    uniforms: torch.Tensor,  # [B, N] float32
    exp_noise: torch.Tensor,  # [B, V] float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:  # nodes [B, N], num [B], emitted [B, N]
    """``kernels.verify_chain.verify_chain_reference``, exactly (its ~30 tensor ops, ~0.35 ms on the demo's
    4,096-token vocabulary, as one C loop); None where the C operator does not run."""
    floats = (probs, draft_probs, uniforms, exp_noise)
    if _native(tokens, *floats) and tokens.dtype == torch.int64 and all(t.dtype == torch.float32 for t in floats):
        return torch.ops.tritonspec_cpu.verify_chain(tokens, probs, draft_probs, uniforms, exp_noise)
    return None


def argmax(x: torch.Tensor) -> torch.Tensor | None:  # [..., V] float32 / bfloat16 -> [...] int64
    """``x.argmax(-1)``, exactly (the lowest index of a row's maximum; a NaN above every number, the first
    NaN), rows split over the intra-op threads: ATen's CPU argmax runs one thread at ~1.7 ns an element
    (SmolLM2's 49,152-token head over a 14-node tree: 1.2 ms a verify); None where the C operator does not
    run.

    Example
    -------
    >>> argmax(torch.tensor([[0.5, 2.0, 2.0], [float("nan"), 1.0, float("nan")]]))  # doctest: +SKIP
    tensor([1, 0])
    """
    if _native(x) and x.dtype in (torch.float32, torch.bfloat16) and x.dim() >= 1 and x.numel() > 0:
        return torch.ops.tritonspec_cpu.argmax(x)
    return None
