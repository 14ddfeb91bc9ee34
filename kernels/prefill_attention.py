"""Prefill attention: causal self-attention of a prompt over its own K/V (an empty prefix).

    out[b, p, h] = softmax_{s <= p}( scale * <Q[b,p,h], K[b,s,h//G]> ) @ V[b, s, h//G]

with G = Hq / Hkv query heads per KV head (GQA). This is tree attention's math for
``prefix_lens == 0`` and a causal tree mask, but PyTorch's causal SDPA (flash attention on a GPU,
a blocked kernel on a CPU) skips the masked half, which the general tree-mask path cannot.
Prefill is not a decode-round op, so there is no Triton kernel: both backends use this function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill_attention(
    q: torch.Tensor,  # [B, P, Hq, D]
    k: torch.Tensor,  # [B, P, Hkv, D]
    v: torch.Tensor,  # [B, P, Hkv, D]
    scale: float,
) -> torch.Tensor:  # [B, P, Hq, D]
    """Causal self-attention of a prompt with an empty prefix: ``softmax(q k^T * scale + causal) v``
    (``tree_attention_reference`` with ``prefix_lens == 0`` and a causal tree mask)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2).to(q.dtype),
        v.transpose(1, 2).to(q.dtype),
        is_causal=True,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)
