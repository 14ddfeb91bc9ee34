"""The unrolled EAGLE-3 training-time test (TTT), built on the serving drafter's own ``step``.

Notation (``../shared/reference/eagle-spec.md`` §7.2): position ``t`` holds the pair
``(g_t, x_{t+1})``; at TTT step ``j`` it runs at RoPE position ``t + j`` with the teacher-forced
token ``x_{t+1+j}`` and predicts ``x_{t+2+j}``, whose teacher is the target's logits at position
``t+1+j``. The carry fed to step ``j+1`` is exactly what ``Eagle3Drafter.step`` returns
(``hn`` for EAGLE-3.1, ``h`` for EAGLE-3), so training and serving cannot disagree.

The "diagonal" mask is expressed with the serving attention op itself: the cache holds
``[step-0 keys for positions 0..T-1 | step-1 keys | ...]`` (plus the trash slot), prefix length
0 makes the whole cache the tree region, and the query at step ``j``, position ``t`` sees
step-0 slots ``s <= t`` and slot ``i*T + t`` for ``i = 1..j``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..runtime.drafter import Eagle3Drafter
from ..runtime.metadata import AttentionMetadata, KVCache

LOSS_DECAY = 0.8


@dataclass
class TTTOutput:
    """Per-depth results of one unrolled forward (lists of length ``depth``)."""

    hn: list[torch.Tensor]  # each [B, T, H]: the normed hidden the logits are computed from
    losses: list[torch.Tensor]  # scalar per depth (0 when no target is given)
    accuracies: list[float]  # top-1 agreement with the target's argmax on valid positions
    loss: torch.Tensor  # sum_j 0.8^j * loss_j


@dataclass
class Teacher:
    """The target's view of every position of a batch, cut to what the loss reads: its argmax over
    the full vocabulary and its distribution renormalised over the draft vocabulary. Built once a
    batch (``teacher_from_logits``) instead of once a depth, and shared by drafters of one draft
    vocabulary: the full-vocabulary logits are then read once a batch, not at every depth of every drafter."""

    probs: torch.Tensor  # [B, T, V_d] float32: softmax of the target logits over the draft vocabulary
    top: torch.Tensor  # [B, T] int64: argmax of the target logits over the full vocabulary
    used: torch.Tensor  # [V_d] int64: the draft vocabulary (target ids) ``probs`` is over

    def shifted(self, n: int) -> Teacher:
        """The teacher of position ``t + n`` at position ``t`` (zeros / id 0 past the end)."""
        return Teacher(shift_left(self.probs, n), shift_left(self.top, n), self.used)


@torch.no_grad()
def teacher_from_logits(
    target_logits: torch.Tensor,  # [B, T, V] float: target logits at each position
    used: torch.Tensor,  # [V_d] int64: target ids of the draft vocabulary
) -> Teacher:
    """``Teacher`` of ``target_logits`` for the draft vocabulary ``used``: per position,
    ``top = argmax_v logits[v]`` and ``probs = softmax(logits[used])`` (float32)."""
    return Teacher(F.softmax(target_logits.index_select(-1, used).float(), dim=-1), target_logits.argmax(-1), used)


def ttt_mask(T: int, j: int, device: torch.device) -> torch.Tensor:
    """``[T, (j+1)*T]`` bool: causal over step-0 slots, plus the diagonal slot of each step 1..j.

    >>> ttt_mask(2, 1, torch.device("cpu")).int().tolist()
    [[1, 0, 1, 0], [1, 1, 0, 1]]
    """
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * j, dim=1)


def grow_cache(
    prev: torch.Tensor | None, B: int, T: int, kv_heads: int, head_dim: int, like: torch.Tensor
) -> torch.Tensor:
    """A new cache ``[B, (j+1)*T + 1, Hkv, D]``: the previous steps' slots copied out of place, then
    ``T`` fresh slots and the trash slot. Never written in place after attention saved it."""
    fresh = torch.zeros(B, T + 1, kv_heads, head_dim, dtype=like.dtype, device=like.device)
    return fresh if prev is None else torch.cat([prev[:, :-1], fresh], dim=1)


def shift_left(x: torch.Tensor, n: int, fill: float | int = 0) -> torch.Tensor:
    """``x[:, n:]`` padded at the end with ``fill`` to the original length (axis 1)."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def ttt_forward(
    drafter: Eagle3Drafter,
    ops: Any,
    aux: torch.Tensor,  # [B, T, n_aux*H_t] target residual streams at the aux boundaries
    tokens: torch.Tensor,  # [B, T] int64 target-vocabulary ids x_0..x_{T-1}
    depth: int,
    target_logits: torch.Tensor | Teacher | None = None,  # [B, T, V] float target logits, or their Teacher
    loss_mask: torch.Tensor | None = None,  # [B, T] bool: positions whose prediction may be trained
) -> TTTOutput:
    """Unroll ``depth`` drafter steps over every position in parallel (one simulated chain each).

    ``target_logits`` may be given as a ``Teacher`` of this drafter's vocabulary (built once a batch
    and shared between drafters); full logits are turned into one here. The loss is the same either way.

    Examples
    --------
    >>> out = ttt_forward(d, TorchOps(), aux, x, depth=7, target_logits=logits)   # doctest: +SKIP
    >>> out.loss.backward()                                                       # doctest: +SKIP
    """
    if depth < 1:
        raise ValueError(f"depth={depth} must be >= 1")
    c = drafter.config
    B, T = tokens.shape
    dev = tokens.device
    index = torch.arange(B * T, device=dev)
    u = drafter.combine(ops, aux.reshape(B * T, -1), index).view(B, T, -1)  # [B, T, H]
    ar = torch.arange(T, device=dev)
    zero = torch.zeros(B, dtype=torch.int64, device=dev)
    if loss_mask is None:
        loss_mask = torch.ones(B, T, dtype=torch.bool, device=dev)
    used = drafter.target_ids()  # draft id -> target id
    teacher = target_logits
    if isinstance(teacher, torch.Tensor):
        teacher = teacher_from_logits(teacher, used)
    elif teacher is not None and not torch.equal(teacher.used, used):
        raise ValueError(
            "the Teacher was built for another draft vocabulary than this drafter's: "
            "build it with teacher_from_logits(logits, drafter.target_ids())"
        )
    k_cache = v_cache = None
    hns, losses, accs = [], [], []
    total = u.new_zeros(())
    for j in range(depth):
        ids = shift_left(tokens, 1 + j)  # [B, T]: x_{t+1+j}
        positions = (ar + j).expand(B, T)
        slots = (j * T + ar).expand(B, T)
        k_cache = grow_cache(k_cache, B, T, c.num_key_value_heads, c.head_dim, u)
        v_cache = grow_cache(v_cache, B, T, c.num_key_value_heads, c.head_dim, u)
        mask = ttt_mask(T, j, dev).expand(B, T, (j + 1) * T)
        hn, u = drafter.step(
            ops, u, ids, AttentionMetadata(positions, slots, zero, mask, (j + 1) * T), KVCache(k_cache, v_cache)
        )
        hns.append(hn)
        if teacher is None:
            losses.append(u.new_zeros(()))
            accs.append(float("nan"))
            continue
        in_range = (ar < T - 1 - j)[None, :] & shift_left(loss_mask, 1 + j, False)
        # the target's view of x_{t+2+j}
        loss_j, acc_j = distill_loss(drafter.logits(hn), teacher.shifted(1 + j), drafter.t2d, in_range)
        losses.append(loss_j)
        accs.append(acc_j)
        total = total + LOSS_DECAY**j * loss_j
    return TTTOutput(hns, losses, accs, total)


def distill_loss(
    draft_logits: torch.Tensor,  # [B, T, V_d]
    teacher: Teacher,  # probs [B, T, V_d], top [B, T]
    t2d: torch.Tensor,  # [V] bool
    valid: torch.Tensor,  # [B, T] bool
) -> tuple[torch.Tensor, float]:
    """Soft cross-entropy to the target restricted to the draft vocabulary (renormalised):
    ``-sum_v p_v log q_v`` with ``p = teacher.probs``, ``q = softmax(draft_logits)``.

    Positions whose target argmax lies outside the draft vocabulary are dropped (§2.5).
    Returns ``(mean loss over valid positions, top-1 accuracy)``.
    """
    top, p, used = teacher.top, teacher.probs, teacher.used  # [B, T], [B, T, V_d], [V_d]
    valid = valid & t2d[top]
    logq = F.log_softmax(draft_logits.float(), dim=-1)
    per_pos = -(p * logq).sum(-1)  # [B, T]
    n = valid.sum()
    loss = (per_pos * valid).sum() / n.clamp(min=1)
    with torch.no_grad():
        hit = (used[draft_logits.argmax(-1)] == top) & valid
        acc = (hit.sum() / n.clamp(min=1)).item()
    return loss, acc
