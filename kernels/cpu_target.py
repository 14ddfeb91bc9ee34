"""The target's decode forward as one C++ operator (``tritonspec_cpu::target_step``, ``kernels/cpu/linear_op.cpp``).

A target forward of a decode round (``runtime/target.py`` ``TargetModel.forward`` for a plain step or a verify,
not a prompt's causal forward) is ~16 small calls a layer: the input RMSNorm, the fused q/k/v
projection, its split, rope on q and k, the K/V write, tree attention, the output projection, the
post-attention RMSNorm with its residual, the fused gate/up projection, SwiGLU's product, the down projection
and the residual add; then the final RMSNorm. On the demo target (12 layers, hidden 128) each is a few
microseconds of work behind ~10-15 us of Python and dispatch: a batch-4 plain step of the standard set's short
prompts took 4.4 ms through the Python forward and 1.6 ms through this operator (one thread). The operator
makes the same kernel calls from C++ on one work buffer:

    h_0 = E[tokens]
    x = RMS_1(h); q, k, v = split(W_qkv x + b_qkv); q, k = rope(RMS_q(q)), rope(RMS_k(k)); cache_l[slots] = k, v
    r = h + W_o Attn(q, cache_l, prefix_lens, tree_mask) + b_o          (biases, RMS_q/k where the model has them)
    h = r + W_down (silu(W_gate x') * W_up x'),  x' = RMS_2(r)                 (per layer l)
    hn = RMS_final(h);  aux = [h_a for a in aux_ids]    (h_0 the embedding, h_l after layer l)

with the same arguments on the same values as the Python forward's wrappers (``cpu_linear``, ``cpu_norm``,
``cpu_rope``, ``cpu_attention``), so its outputs, and the K/V it writes, are the Python forward's bit for bit
(``tests/test_cpu_target.py``). Qwen2's q/k/v biases (an output bias too) go into the projections' kernel
calls and Qwen3's per-head q/k norms run before rope, as in the Python forward (a demo-sized Qwen3, 12 layers,
hidden 128, one thread: a one-token forward 3.1 ms -> 0.77 ms, 8 tokens 4.1 -> 1.2 ms). Targets with
bfloat16 activations (weights in bfloat16 panels or AMX tiles) run the operator's ATen path: the Python forward's
wrapper calls made from C++ in the same order on the same tensors, so the same bits without the Python
dispatches (SmolLM2 in bfloat16 on AMX, two threads: plain decoding 24.1 -> 16.1 ms/token, EAGLE-3.1 11.4 -> 9.1).
What it does not take (a kind of weight in some layers only, weights not packed, head shapes the attention
kernel declines, a traced call, no native operator) runs the Python forward: ``target_step`` returns None there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_linear as _lib
from .cpu_attention import MAX_GROUP, MAX_HEAD_DIM
from .cpu_rope import _tracing

_calls = 0  # forwards the operator ran in this process (tests see the path taken)


def calls() -> int:
    """How many forwards ``target_step`` ran through the operator so far in this process."""
    return _calls


@dataclass(frozen=True, eq=False)
class TargetWeights:
    """The target's weights as the operator takes them, checked once (``prepare``): one list per kind, a
    weight per layer."""

    embed: torch.Tensor  # [V, H] float32
    ln1: list[torch.Tensor]  # [H] each
    qkv: list[torch.Tensor]  # [(Hq + 2 Hkv) D / 16, H, 16] panels
    o: list[torch.Tensor]  # [H / 16, Hq D, 16]
    ln2: list[torch.Tensor]  # [H]
    gate_up: list[torch.Tensor]  # [2 I / 16, H, 16]
    down: list[torch.Tensor]  # [H / 16, I, 16]
    final_norm: torch.Tensor  # [H]
    cos: torch.Tensor  # [max_pos, D]
    sin: torch.Tensor  # [max_pos, D]
    heads: tuple[int, int, int]  # (Hq, Hkv, D)
    # optional, one per layer or none: Qwen2's q/k/v biases, an output bias, Qwen3's per-head q/k norms
    bqkv: list[torch.Tensor] = ()  # [(Hq + 2 Hkv) D] each
    bo: list[torch.Tensor] = ()  # [H]
    q_norm: list[torch.Tensor] = ()  # [D]
    k_norm: list[torch.Tensor] = ()  # [D]

    def tensors(self) -> tuple:
        return (
            self.embed,
            self.ln1,
            self.qkv,
            self.o,
            self.ln2,
            self.gate_up,
            self.down,
            self.final_norm,
            self.cos,
            self.sin,
        )


def _packed(embed: torch.Tensor, w: torch.Tensor) -> bool:
    """A projection the operator takes under ``embed``'s activations: panels (``pack_panels``) of its dtype or
    weight-only bfloat16 ones (``dtypes_match``), or for bfloat16 activations AMX tiles (``pack_bf16``, 4-D)."""
    if w.dim() == 4:
        return embed.dtype == torch.bfloat16 and w.dtype == torch.bfloat16
    return w.dim() == 3 and _lib.dtypes_match(embed, w)


def prepare(
    embed: torch.Tensor,  # [V, H]
    layers: list[tuple[torch.Tensor | None, ...]],  # per layer (ln1, qkv, o, ln2, gate_up, down, bqkv, bo, qn, kn)
    final_norm: torch.Tensor,  # [H]
    cos: torch.Tensor,  # [max_pos, D]
    sin: torch.Tensor,  # [max_pos, D]
    heads: tuple[int, int, int],  # (Hq, Hkv, D)
) -> TargetWeights | None:
    """The weights in the operator's form, or None where it does not take them: a float32 or bfloat16 embedding
    (the activations' dtype), norms and rope tables of that dtype; every projection packed as the Python forward's
    ``cpu_linear`` calls take it (``_packed``: panels, weight-only bfloat16 panels under float32, AMX tiles under
    bfloat16); head shapes within the attention kernel's limits. A layer's optional weights (q/k/v bias, output
    bias, per-head q and k norms; None where absent) are vectors of that dtype, each kind in every layer or in
    none."""
    hq, hkv, d = heads
    dt = embed.dtype  # the activations' dtype: every vector, table and cache shares it
    if dt not in (torch.float32, torch.bfloat16) or embed.dim() != 2 or not embed.is_contiguous() or not layers:
        return None
    if hkv <= 0 or hq % hkv or hq // hkv > MAX_GROUP or d > MAX_HEAD_DIM or d % 2:
        return None
    optional: list[list[torch.Tensor]] = []
    for kind, n in zip(list(zip(*layers))[6:], ((hq + 2 * hkv) * d, embed.shape[1], d, d), strict=True):
        if all(t is None for t in kind):
            optional.append([])
            continue
        if any(t is None or t.dtype != dt or t.dim() != 1 or t.numel() != n or not t.is_contiguous() for t in kind):
            return None
        optional.append(list(kind))
    if bool(optional[2]) != bool(optional[3]):
        return None
    for ln1, qkv, o, ln2, gate_up, down, *_ in layers:
        if any(n.dtype != dt or n.dim() != 1 or not n.is_contiguous() for n in (ln1, ln2)):
            return None
        if any(not w.is_contiguous() or not _packed(embed, w) for w in (qkv, o, gate_up, down)):
            return None
    if final_norm.dtype != dt or any(t.dtype != dt or not t.is_contiguous() for t in (cos, sin)):
        return None
    ln1, qkv, o, ln2, gate_up, down = (list(w) for w in zip(*(L[:6] for L in layers)))
    return TargetWeights(embed, ln1, qkv, o, ln2, gate_up, down, final_norm, cos, sin, heads, *optional)


def supported(
    w: TargetWeights,
    tokens: torch.Tensor,  # [B, Q] int64
    positions: torch.Tensor,  # [B, Q] int64
    slots: torch.Tensor,  # [B, Q] int64
    k_cache: torch.Tensor,  # [L, B_max, S, Hkv, D]
    v_cache: torch.Tensor,
    prefix_lens: torch.Tensor,  # [B] int64
    tree_mask: torch.Tensor,  # [B, Q, T] bool
) -> bool:
    """Whether the operator takes one forward's tensors with the results of the Python forward: each check is
    one the Python wrappers make before they run a kernel instead of a reference (caches of the weights' dtype with
    contiguous heads, int64 indices of one shape (made contiguous for the call), a bool mask, no autograd)."""
    _, hkv, d = w.heads
    if k_cache.dtype != w.embed.dtype or v_cache.dtype != w.embed.dtype or k_cache.dim() != 5:
        return False
    if v_cache.shape != k_cache.shape or k_cache.shape[0] != len(w.ln1) or k_cache.shape[1] < tokens.shape[0]:
        return False
    if k_cache.shape[3:] != (hkv, d) or any(c.stride(4) != 1 or c.stride(3) != d for c in (k_cache, v_cache)):
        return False
    idx = (tokens, positions, slots)
    if any(t.dtype != torch.int64 or t.dim() != 2 or t.shape != tokens.shape for t in idx):
        return False
    return (
        prefix_lens.dtype == torch.int64
        and prefix_lens.is_contiguous()
        and tree_mask.dtype == torch.bool
        and tree_mask.dim() == 3
        and tree_mask.shape[:2] == tokens.shape
        and not torch.is_grad_enabled()
    )


def target_step(
    w: TargetWeights,
    tokens: torch.Tensor,  # [B, Q] int64
    positions: torch.Tensor,  # [B, Q] int64
    slots: torch.Tensor,  # [B, Q] int64, -1 = the trash slot
    k_cache: torch.Tensor,  # [L, B_max, S, Hkv, D], layer l written at slots
    v_cache: torch.Tensor,  # [L, B_max, S, Hkv, D]
    prefix_lens: torch.Tensor,  # [B] int64
    tree_mask: torch.Tensor,  # [B, Q, T] bool
    eps: float,
    scale: float,
    kv_len: int | None,  # slots >= kv_len are never read (None: the whole cache)
    aux_ids: tuple[int, ...],  # residual-stream boundaries to capture (0 = the embedding)
) -> tuple[torch.Tensor, torch.Tensor | None] | None:  # (hn [B, Q, H], aux [B, Q, n_aux * H] or None), or None
    """The decode forward as one native call where ``supported`` holds and the operator loaded (eager calls
    only), else None (the caller runs the Python forward).

    Example
    -------
    >>> w = prepare(embed, layers, final_norm, cos, sin, (4, 2, 32))  # doctest: +SKIP
    >>> out = target_step(w, tokens, positions, slots, kc, vc, lens, mask, 1e-5, 0.18, None, ())  # doctest: +SKIP
    """
    global _calls
    if _tracing(tokens) or not _lib._native_ready():
        return None
    if not supported(w, tokens, positions, slots, k_cache, v_cache, prefix_lens, tree_mask):
        return None
    # a grafted tree's tokens may be a strided view (the lookup branch): the operator reads rows of B x Q ids
    tokens, positions, slots = tokens.contiguous(), positions.contiguous(), slots.contiguous()
    hn, aux = torch.ops.tritonspec_cpu.target_step(
        tokens, *w.tensors(), positions, slots, k_cache, v_cache, prefix_lens, tree_mask, float(eps), float(scale),
        -1 if kv_len is None else int(kv_len), *w.heads, list(aux_ids), list(w.bqkv), list(w.bo), list(w.q_norm),
        list(w.k_norm),
    )  # fmt: skip
    _calls += 1
    return hn, (aux if aux_ids else None)
