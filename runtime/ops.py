"""The op layer: every hot-path call site in the runtime goes through one ``Ops`` object.

``backend="torch"`` uses the plain PyTorch ``<op>_reference`` functions from ``kernels/``
(the reference path, and the fast path on a CPU). ``backend="triton"`` swaps in the Triton
launchers (``kernels/triton_ops.py``) without touching the runtime code above.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..kernels.aux_gather import aux_gather_reference
from ..kernels.kv_compact import kv_compact_reference
from ..kernels.rms_norm import rms_norm_reference
from ..kernels.tree_attention import kv_write_reference, prefill_attention, tree_visibility
from ..kernels.verify import verify_greedy_reference
from ..kernels.verify_chain import verify_chain_reference
from ..kernels.verify_sampling import verify_sampling_reference

BACKENDS = ("auto", "torch", "triton")


class TorchOps:
    """Reference backend: each method is the matching ``kernels.<op>.<op>_reference``."""

    name = "torch"

    rms_norm = staticmethod(rms_norm_reference)
    aux_gather = staticmethod(aux_gather_reference)
    kv_write = staticmethod(kv_write_reference)

    def __init__(self) -> None:
        self._vis: tuple | None = None  # (prefix_lens, tree_mask, kv_len, visibility) of this forward

    def begin_forward(self) -> None:
        """A new model forward starts: forget the cached visibility mask (the round updates
        ``prefix_lens`` in place, so the same tensor object holds new lengths in the next forward)."""
        self._vis = None

    def tree_attention(self, q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len=None):
        """``kernels.tree_attention.tree_attention_reference``, with two CPU speed-ups that do not
        change the math: the visibility mask is built once per forward (every layer passes the same
        ``prefix_lens``/``tree_mask`` objects; ``begin_forward`` clears it) and GQA heads are
        broadcast, not copied."""
        B = q.shape[0]
        S = k_cache.shape[1] if kv_len is None else kv_len
        c = self._vis
        if c is None or c[0] is not prefix_lens or c[1] is not tree_mask or c[2] != S:
            c = self._vis = (prefix_lens, tree_mask, S, tree_visibility(prefix_lens, tree_mask, S)[:, None])
        k = k_cache[:B, :S].transpose(1, 2).to(q.dtype)  # [B, Hkv, S, D]
        v = v_cache[:B, :S].transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=c[3], scale=scale,
                                             enable_gqa=q.shape[2] != k.shape[1])
        return out.transpose(1, 2)
    prefill_attention = staticmethod(prefill_attention)
    verify_greedy = staticmethod(verify_greedy_reference)
    verify_sampling = staticmethod(verify_sampling_reference)
    verify_chain = staticmethod(verify_chain_reference)
    kv_compact = staticmethod(kv_compact_reference)


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` is ``triton`` on a CUDA device when Triton imports, else ``torch``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend != "auto":
        return backend
    if device.type == "cuda":
        try:
            import triton  # noqa: F401

            from ..kernels import triton_ops  # noqa: F401

            return "triton"
        except ImportError:
            return "torch"
    return "torch"


def get_ops(backend: str) -> TorchOps:
    """The ``Ops`` object for a resolved backend name (``torch`` or ``triton``)."""
    if backend == "torch":
        return TorchOps()
    if backend == "triton":
        try:
            from ..kernels.triton_ops import TritonOps
        except ImportError as e:  # triton missing or kernels not built
            raise ImportError(
                f"backend='triton' needs the triton package and tritonspec.kernels.triton_ops ({e}); "
                "install with `pip install 'tritonspec[triton]'` or use backend='torch'"
            ) from e
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "backend='triton' on a machine without CUDA needs TRITON_INTERPRET=1 set before triton is "
                "imported (slow; for tests), or use backend='torch'"
            )
        return TritonOps()
    raise ValueError(f"unresolved backend {backend!r}")
