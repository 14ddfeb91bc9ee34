"""What one model forward needs to know about where its tokens go and what they see.

Every forward of the target (``TargetModel.forward``) and every drafter step
(``Eagle3Drafter.step``) takes one ``AttentionMetadata`` instead of five positional index
tensors, so no call site can swap two of them. ``KVCache`` pairs a K and a V cache.

Slots and visibility (the convention of ``kernels/tree_attention.py``): row ``b``'s token ``i``
is written at cache slot ``slots[b, i]`` (-1: the trash slot, nowhere visible) and attends to
slots ``[0, prefix_lens[b])`` (the committed prefix) plus the tree-region slots
``prefix_lens[b] + j`` with ``tree_mask[b, i, j]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Positions, cache slots and visibility of one forward over ``[B, Q]`` tokens.

    Attributes
    ----------
    positions : ``[B, Q]`` int64 rope positions.
    slots : ``[B, Q]`` int64 cache slot of each token (-1 = write nowhere).
    prefix_lens : ``[B]`` int64 committed prefix every token of the row sees.
    tree_mask : ``[B, Q, T]`` bool visibility inside the tree region (slots from ``prefix_lens``);
        None with ``prefill``, whose mask is implied.
    kv_len : attend over cache slots ``[0, kv_len)`` only (None = the whole cache; a captured
        graph cannot know the lengths, eager rounds pass the host-known bound).
    prefill : the prompt's own forward: empty prefix, causal visibility over left-aligned rows;
        attention then runs causally over the new K/V (``ops.prefill_attention``), which reads no
        mask, so none is built (a 2,000-token prompt's would be 4 MB of bools, ~1.5 ms to build).
    """

    positions: torch.Tensor  # [B, Q] int64
    slots: torch.Tensor  # [B, Q] int64
    prefix_lens: torch.Tensor  # [B] int64
    tree_mask: torch.Tensor | None  # [B, Q, T] bool; None with prefill (causal)
    kv_len: int | None = None
    prefill: bool = False


@dataclass(frozen=True)
class KVCache:
    """A K and a V cache of one attention layer stack: ``[..., B_max, S+1, Hkv, D]`` each (slot S is
    the trash slot)."""

    k: torch.Tensor
    v: torch.Tensor
