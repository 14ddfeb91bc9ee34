"""One EAGLE-3 drafter step as one C++ operator (``tritonspec_cpu::drafter_step``, ``kernels/cpu/linear_op.cpp``).

A drafter step of a decode round (``runtime/drafter.py`` ``Eagle3Drafter.step``, not a prompt's causal
forward) is ~20 small calls: two RMSNorms, the fused q/k/v projection, rope on q and k, two K/V
writes, tree attention, the output projection, the post-attention RMSNorm with its residual, the fused
gate/up projection, SiLU and product, the down projection, the residual add and the final RMSNorm.
On the demo drafter (hidden 128) each is a few microseconds of work behind ~10 us of Python and
dispatch: a step took ~340 us. The operator makes the same calls from C++: the same kernel wrappers
(``cpu_linear``, ``cpu_norm``, ``cpu_rope``, ``cpu_attention``) and the same ATen ops (embedding, cat,
silu, mul, add) with the same arguments in the same order, so its outputs are the Python step's bit for
bit (``tests/test_cpu_drafter.py``).

    e = RMS_in(E[y]); v = RMS_hid(u); z = [e; v]
    q, k, val = split(W_qkv z); q, k = rope(q), rope(k); cache[slots] = k, val
    r = (v or u) + W_o Attn(q, cache, prefix_lens, tree_mask)
    h = r + W_down (silu(W_gate x) * W_up x), x = RMS_post(r);  hn = RMS_norm(h)

``draft_chain`` (``tritonspec_cpu::draft_chain``) runs a whole greedy top-1 chain the same way: per depth the
head's logits, ``log_softmax``, the top-1 id and its target id, then that ``drafter_step``, all from C++.

Float32 activations (weights float32 or weight-only bfloat16 panels) take a faster path in both operators: the
same C kernels called on one work buffer per call instead of ~30 ATen tensors a step (SiLU stays ATen's
``silu_out`` on the same shapes; the product, residual add and embedding copy are single IEEE operations), so
the same bits; the chain then picks each depth's first largest logit, the top-1 of log q wherever that is
unique (``log_softmax`` subtracts one constant per row). Demo pair, Intel Xeon, one thread (2026-12-06): a
7-token chain 565 -> 258 us, the round's draft phase 0.60 -> 0.42 ms.

Two more operators take the rest of a greedy round's drafter work to C++ on that path: ``catch_up``
(``tritonspec_cpu::catch_up``: ``Decoder._catch_up`` of a decode round, the accepted path's features gathered and
fused, one step, each row's last state; ~0.26 -> ~0.19 ms a demo round with its Python around it) and
``draft_tree`` (``tritonspec_cpu::draft_tree``: the EAGLE-2 expansion for ``top_k > 1``, the ATen calls of
``Decoder.draft`` for the sorts and picks, the raw step for the frontier; a (3, 2, 7) demo draft 0.77 -> 0.44 ms).
Both give the Python path's values bit for bit (``tests/test_cpu_drafter.py`` compares the drafter state, the
committed draft K/V and every tree, round by round).
``Decoder.draft`` drafts its top-1 chains with it (``Eagle3Drafter.native_chain``): on the demo pair a 7-token
chain's Python loop spent ~65 us of interpreter time a depth besides the ops (2026-12-06, Intel Xeon, one
thread, a distillation running beside: the round's draft 1.57 -> 0.99 ms under a profiler, EAGLE-3.1 decode
2.03x -> 2.21x over plain in one process; ``perf/CPU_DECODE.md``).

``drafter_step`` returns None where it does not apply (a projection not packed into panels, dtypes
that differ, head shapes the attention kernel declines, no native operator, a traced call); the caller
then runs the Python step. The reference is that Python step (``Eagle3Drafter.step`` with
``native_step = False``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_linear as _lib
from .cpu_attention import MAX_GROUP, MAX_HEAD_DIM
from .cpu_rope import _tracing

_PROJECTIONS = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True, eq=False)
class DrafterLayer:
    """The drafter's weights and constants every operator here takes, gathered once a round
    (``Eagle3Drafter._native_layer``)."""

    embed: torch.Tensor  # [V, H] the embedding table
    norms: tuple[torch.Tensor, ...]  # input_layernorm, hidden_norm, post_attention_layernorm, norm: [H] each
    packed: dict[str, torch.Tensor]  # Eagle3Drafter._cpu_weights: "qkv", "o", "gate_up", "down" (+ "head", "fc")
    cos: torch.Tensor  # [max_pos, D] rope tables
    sin: torch.Tensor  # [max_pos, D]
    eps: float
    scale: float  # the attention scale
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_before_residual: bool
    norm_output: bool

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The layer's tensors in the order every operator takes them: the embedding, the input and hidden norms,
        the q/k/v and output projections, the post-attention norm, gate/up and down, the final norm, the rope
        tables."""
        n_in, n_hid, n_post, n_out = self.norms
        p = self.packed
        return self.embed, n_in, n_hid, p["qkv"], p["o"], n_post, p["gate_up"], p["down"], n_out, self.cos, self.sin

    def scalars(self, kv_len: int | None) -> tuple[float, float, int]:
        """eps, the attention scale and the attention bound (-1: the whole cache) as the operators take them."""
        return float(self.eps), float(self.scale), -1 if kv_len is None else int(kv_len)

    def heads(self) -> tuple[int, int, int]:
        return self.num_heads, self.num_kv_heads, self.head_dim


def supported(
    hidden: torch.Tensor,  # [B, Q, H]
    tokens: torch.Tensor,  # [B, Q]
    positions: torch.Tensor,  # [B, Q] (the Python step would broadcast other shapes)
    layer: DrafterLayer,
    k_cache: torch.Tensor,  # [B_max, S, Hkv, D]
    v_cache: torch.Tensor,  # [B_max, S, Hkv, D]
    slots: torch.Tensor,  # [B, Q] int64
    prefix_lens: torch.Tensor,  # [B] int64
    tree_mask: torch.Tensor,  # [B, Q, T] bool
) -> bool:
    """Whether the operator takes these tensors with the results of the Python step (the checks each
    kernel's Python launcher makes before it runs the kernel instead of a reference)."""
    if hidden.dim() != 3 or not _weights_ok(hidden, layer, k_cache, v_cache, prefix_lens):
        return False
    return (
        slots.dtype == torch.int64
        and slots.is_contiguous()
        and slots.shape == hidden.shape[:2]
        and positions.shape == hidden.shape[:2]
        and tokens.shape == hidden.shape[:2]
        and tree_mask.dtype == torch.bool
        and tree_mask.dim() == 3
    )


def _weights_ok(
    x: torch.Tensor,  # [B, ...] the step's input: its dtype and row count
    layer: DrafterLayer,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_lens: torch.Tensor,
) -> bool:
    """``supported``'s checks that do not depend on one step's tokens, positions, slots and mask: the dtypes,
    the packed projections, the norms, the head shapes, the caches' layout, ``prefix_lens``, autograd off."""
    dt = x.dtype
    if dt not in _lib.DTYPES or k_cache.dtype != dt or v_cache.dtype != dt:
        return False
    if any(layer.packed[n].dim() != 3 or not _lib.dtypes_match(x, layer.packed[n]) for n in _PROJECTIONS):
        return False  # panels of the drafter's dtype, or weight-only bfloat16 ones
    if any(w.dtype != dt or w.dim() != 1 or not w.is_contiguous() for w in layer.norms):
        return False
    hq, hkv, d = layer.heads()
    if hkv <= 0 or hq % hkv or hq // hkv > MAX_GROUP or d > MAX_HEAD_DIM:
        return False
    if d % 2 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2:] != (hkv, d):
        return False
    if any(c.stride(3) != 1 or c.stride(2) != d for c in (k_cache, v_cache)) or k_cache.shape[0] < x.shape[0]:
        return False
    return prefix_lens.dtype == torch.int64 and prefix_lens.is_contiguous() and not torch.is_grad_enabled()


def drafter_step(
    hidden: torch.Tensor,  # [B, Q, H] fused target features or the previous step's carry
    tokens: torch.Tensor,  # [B, Q] int64 target ids
    layer: DrafterLayer,
    positions: torch.Tensor,  # [B, Q] int64
    slots: torch.Tensor,  # [B, Q] int64, -1 = the trash slot
    k_cache: torch.Tensor,  # [B_max, S, Hkv, D], written at slots
    v_cache: torch.Tensor,  # [B_max, S, Hkv, D]
    prefix_lens: torch.Tensor,  # [B] int64
    tree_mask: torch.Tensor,  # [B, Q, T] bool
    kv_len: int | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:  # (hn, h) [B, Q, H] each, or None: run the Python step
    """The step as one native call where ``supported`` holds and the operator loaded (eager calls only),
    else None."""
    if _tracing(hidden) or not _lib._native_ready():
        return None
    if not supported(hidden, tokens, positions, layer, k_cache, v_cache, slots, prefix_lens, tree_mask):
        return None
    return torch.ops.tritonspec_cpu.drafter_step(
        hidden, tokens, *layer.tensors(), positions, slots, k_cache, v_cache, prefix_lens, tree_mask,
        *layer.scalars(kv_len), *layer.heads(), layer.norm_before_residual,
    )  # fmt: skip


def _drafting_ok(hn: torch.Tensor, carry: torch.Tensor, layer: DrafterLayer, d2t: torch.Tensor, prefix_lens,
                 active: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:  # fmt: skip
    """``draft_chain``'s and ``draft_tree``'s checks: eager, the operator loaded, ``[B, H]`` states, the head
    packed, the ids and row flags typed, and ``_weights_ok``."""
    if _tracing(hn) or not _lib._native_ready() or hn.dim() != 2 or carry.shape != hn.shape:
        return False
    head = layer.packed.get("head")
    if head is None or head.dim() != 3 or not _lib.dtypes_match(hn, head):
        return False
    if d2t.dtype != torch.int64 or active.dtype != torch.bool or active.shape != prefix_lens.shape:
        return False
    # each step's tokens, positions, slots and mask are built by the operator in the shapes supported() wants
    return _weights_ok(hn, layer, k_cache, v_cache, prefix_lens)


def draft_chain(
    hn: torch.Tensor,  # [B, H] the last catch-up state's normed hidden (depth 1's logits)
    carry: torch.Tensor,  # [B, H] its carried state (the first step's hidden)
    layer: DrafterLayer,  # with the draft head packed into panels (packed["head"], [Vd/16, H, 16])
    d2t: torch.Tensor,  # [Vd] int64: target id - draft id
    prefix_lens: torch.Tensor,  # [B] int64 (L)
    active: torch.Tensor,  # [B] bool: rows that write K/V
    k_cache: torch.Tensor,  # [B_max, S, Hkv, D]
    v_cache: torch.Tensor,  # [B_max, S, Hkv, D]
    kv_len: int | None,
    n: int,
) -> torch.Tensor | None:  # [B, n] int64 target ids, or None: run the Python loop
    """The greedy top-1 chain of ``n`` draft tokens as one native call (``tritonspec_cpu::draft_chain``):
    per depth s, ``log_softmax`` of the head's logits, the top-1 id (``topk``; on float32 activations the first
    largest logit, the same id wherever the top-1 is unique), its target id, and below
    depth n one ``drafter_step`` on it at position ``L + s`` seeing the chain so far: the calls
    ``Decoder.draft_chain`` makes with the tree's top-1 pick, in the same order, so the same tokens. None
    where ``drafter_step`` would decline (``supported``'s checks of the weights, caches and heads), the head is
    not packed, or the call is traced."""
    if not _drafting_ok(hn, carry, layer, d2t, prefix_lens, active, k_cache, v_cache):
        return None
    return torch.ops.tritonspec_cpu.draft_chain(
        hn, carry, layer.packed["head"], d2t, prefix_lens, active, *layer.tensors(), k_cache, v_cache,
        *layer.scalars(kv_len), *layer.heads(), layer.norm_before_residual, layer.norm_output, int(n),
    )  # fmt: skip


def draft_chain_sampled(
    hn: torch.Tensor,  # [B, H] the last catch-up state's normed hidden (depth 1's logits)
    carry: torch.Tensor,  # [B, H] its carried state
    layer: DrafterLayer,  # with the draft head packed into panels
    d2t: torch.Tensor,  # [Vd] int64: target id - draft id
    prefix_lens: torch.Tensor,  # [B] int64 (L)
    active: torch.Tensor,  # [B] bool
    k_cache: torch.Tensor,  # [B_max, S, Hkv, D]
    v_cache: torch.Tensor,  # [B_max, S, Hkv, D]
    kv_len: int | None,
    n: int,
    xi: torch.Tensor,  # [B, n, Vd] float32 Exp(1) noise (RowRandom.draw)
    temperature: float,
    vocab: int,  # the target's vocabulary size V
) -> tuple[torch.Tensor, torch.Tensor] | None:  # (target ids [B, n], q [B, n, V]), or None
    """``Decoder._draft_sampled_chain``'s chain at ``top_k = 0, top_p = 1`` as one native call
    (``tritonspec_cpu::draft_chain_sampled``, float32 activations): per depth s, ``log q = log_softmax(logits /
    temperature)`` of the head, the token ``argmax(log q - log xi[:, s])`` (the exponential race), its target id
    and below depth n one drafter step on it; then q, ``exp(log q)`` placed at the target ids of a ``[B, n, V]``
    zero tensor. The transcendental functions by the ATen calls the Python loop makes on the same tensors, the
    rest exact IEEE operations, so the same tokens and q bits. None where ``draft_chain`` would decline or the
    activations are not float32 (the caller then runs its Python loop)."""
    if hn.dtype != torch.float32 or xi.dtype != torch.float32 or xi.shape != (*hn.shape[:1], n, xi.shape[-1]):
        return None
    if not _drafting_ok(hn, carry, layer, d2t, prefix_lens, active, k_cache, v_cache):
        return None
    toks, q = torch.ops.tritonspec_cpu.draft_chain_sampled(
        hn, carry, layer.packed["head"], d2t, prefix_lens, active, *layer.tensors(), k_cache, v_cache,
        *layer.scalars(kv_len), *layer.heads(), layer.norm_before_residual, layer.norm_output, int(n), xi,
        float(temperature), int(vocab),
    )  # fmt: skip
    return None if toks.numel() == 0 and hn.shape[0] > 0 else (toks, q)


def catch_up(
    aux: torch.Tensor,  # [B * N, n_aux * H_t] the verify's captured target features, row b * N + node
    nodes: torch.Tensor,  # [B, W] int64: the accepted path's node ids, -1 past it
    emitted: torch.Tensor,  # [B, W] int64: the tokens at those nodes (-1 past the path)
    num: torch.Tensor,  # [B] int64: accepted draft tokens
    active: torch.Tensor,  # [B] bool
    prefix_lens: torch.Tensor,  # [B] int64 (L before the commit)
    N: int,  # tree nodes per row
    qc: int,  # columns re-encoded: > 0 that many, else up to the longest accepted path
    layer: DrafterLayer,  # with the fc projection packed into panels (packed["fc"])
    fc_norm: torch.Tensor | None,  # [n_aux, H_t] (EAGLE-3.1's fc_norm) or None
    fc_in_norm: torch.Tensor | None,  # [n_aux * H_t] (norm_before_fc) or None
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    hn_out: torch.Tensor,  # [B, H] written: each row's hn at its last accepted position
    carry_out: torch.Tensor,  # [B, H] written: its carried state
    kv_len: int | None,
) -> bool:  # False: nothing written, run the Python catch-up
    """``Decoder._catch_up`` of a decode round as one native call (``tritonspec_cpu::catch_up``): the path's
    features gathered and fused (``Eagle3Drafter.combine``), one drafter step over them and each row's state at
    its last accepted position, from C++ on raw buffers (float32 activations): the calls the Python catch-up
    makes, so the same bits (``tests/test_cpu_drafter.py``). Demo pair, one thread: a round's catch-up
    ~0.26 -> ~0.19 ms with its Python around it."""
    if _tracing(aux) or not _lib._native_ready() or "fc" not in layer.packed:
        return False
    if not _weights_ok(aux.view(nodes.shape[0], -1), layer, k_cache, v_cache, prefix_lens):
        return False
    return torch.ops.tritonspec_cpu.catch_up(
        aux, nodes, emitted, num, active, prefix_lens, int(N), int(qc), layer.packed["fc"], fc_norm, fc_in_norm,
        *layer.tensors(), k_cache, v_cache, hn_out, carry_out, *layer.scalars(kv_len), *layer.heads(),
        layer.norm_before_residual, layer.norm_output,
    )  # fmt: skip


def draft_tree(
    hn: torch.Tensor,  # [B, H] the last catch-up state's normed hidden
    carry: torch.Tensor,  # [B, H] its carried state
    layer: DrafterLayer,  # with the draft head packed into panels (packed["head"])
    d2t: torch.Tensor,  # [Vd] int64
    prefix_lens: torch.Tensor,  # [B] int64 (L)
    active: torch.Tensor,  # [B] bool
    root: torch.Tensor,  # [B] int64: each row's root token
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_len: int | None,
    K: int,
    D: int,
    N: int,
) -> tuple[torch.Tensor, ...] | None:  # (node_tokens, parents, depth, mask), or None: run the Python expansion
    """``Decoder.draft``'s greedy EAGLE-2 expansion for ``top_k = K > 1`` as one native call
    (``tritonspec_cpu::draft_tree``): per depth the frontier's drafter step (raw buffers), ``log_softmax`` and
    ``topk`` of the head, cumulative scores, the stable sort that picks the next frontier; then the rerank and
    ``build_tree``. The Python expansion's calls on the same values, so the same tree (``tests/test_cpu_drafter.py``).
    None where the operator declines (not float32, weights not packed) or the call is traced."""
    if not _drafting_ok(hn, carry, layer, d2t, prefix_lens, active, k_cache, v_cache):
        return None
    out = torch.ops.tritonspec_cpu.draft_tree(
        hn, carry, layer.packed["head"], d2t, prefix_lens, active, root, *layer.tensors(), k_cache, v_cache,
        *layer.scalars(kv_len), *layer.heads(), layer.norm_before_residual, layer.norm_output, int(K), int(D), int(N),
    )  # fmt: skip
    return None if out[0].numel() == 0 else out
