"""Tree attention: query tokens attend to a cached prefix plus the tree's own tokens.

One op serves the target (prefill, plain decode, tree verify) and the drafter (catch-up,
tree levels). Per row ``b`` the cache holds a committed prefix in slots ``[0, prefix_lens[b])``
followed by a tree region of width T starting at slot ``prefix_lens[b]``. Query ``q`` sees:

    slot s < prefix_lens[b]                                   (the whole prefix), and
    slot prefix_lens[b] + t   where tree_mask[b, q, t]         (its ancestors and itself)

    out[b, q, h] = softmax_s( scale * <Q[b,q,h], K[b,s,h//G]> | visible ) @ V[b, s, h//G]

with G = Hq / Hkv query heads per KV head (GQA). The queries' own K/V must already be written
into the cache (``kv_write_reference``). A causal mask over the tree region gives ordinary
causal attention (prefill, catch-up); a 1x1 mask gives one-token decode.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def kv_write_reference(
    k_cache: torch.Tensor,  # [B_max, S, Hkv, D] (one layer)
    v_cache: torch.Tensor,  # [B_max, S, Hkv, D]
    slots: torch.Tensor,  # [B, Q] int64 absolute slot per query; -1 = write nowhere
    k: torch.Tensor,  # [B, Q, Hkv, D]
    v: torch.Tensor,  # [B, Q, Hkv, D]
) -> None:
    """Scatter the new tokens' K/V into the cache. Slot -1 goes to the trash slot ``S - 1``."""
    batch, nq = slots.shape
    trash = k_cache.shape[1] - 1
    slot = torch.where(slots >= 0, slots, trash)
    rows = torch.arange(batch, device=slots.device)[:, None].expand(batch, nq)
    k_cache[rows, slot] = k.to(k_cache.dtype)
    v_cache[rows, slot] = v.to(v_cache.dtype)


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
