"""The Triton backend of the op layer (``runtime.ops.get_ops("triton")``).

``TritonOps`` provides every method of the ``runtime.ops.Ops`` protocol, with ``TorchOps``'
signatures (structurally: this module does not import the runtime); each is the launcher in the
op's kernel module. On a CPU the launchers run under ``TRITON_INTERPRET=1`` (set before triton
is imported), which is how the tests exercise them.
"""

from __future__ import annotations

import torch

from .aux_gather import aux_gather
from .cpu_norm import silu_mul_reference
from .cpu_rope import rope_reference
from .kv_compact import kv_compact
from .kv_write import kv_write
from .prefill_attention import prefill_attention
from .rms_norm import rms_norm
from .tree_attention import tree_attention
from .utils import require_triton
from .verify import verify_greedy
from .verify_chain import verify_chain
from .verify_sampling import verify_sampling

require_triton()  # importing this module without triton raises ImportError (runtime.ops relies on it)


class TritonOps:
    """Triton backend: each method is the launcher of ``kernels.<op>``."""

    name = "triton"

    def begin_forward(self, prompt: bool = False) -> None:
        """Nothing cached between layers (``TorchOps.begin_forward`` has the counterpart)."""

    def linear(self, x, weight, bias=None):
        """cuBLAS GEMMs (``F.linear``); the deterministic mode swaps in ``batch_invariant_matmul``. A CPU
        weight packed for the CPU kernel (``weight_layout="panels"``/``"amx"``, the interpreter's CPU
        runs) runs that kernel: it is the only one that reads the packed layout."""
        if weight.dim() >= 3:
            from . import cpu_linear

            return cpu_linear.linear(x, weight, bias)
        return torch.nn.functional.linear(x, weight, bias)

    rms_norm = staticmethod(rms_norm)  # (x, weight, eps, residual=None)
    aux_gather = staticmethod(aux_gather)  # (aux, index, fc_norm_weight, eps)
    kv_write = staticmethod(kv_write)  # (k_cache, v_cache, slots, k, v)
    rope = staticmethod(rope_reference)  # (x, cos, sin): elementwise, fused by the compiler where captured
    silu_mul = staticmethod(silu_mul_reference)  # (gate_up): PyTorch's F.silu(g) * u, as before the op existed
    tree_attention = staticmethod(tree_attention)  # (q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len=None)
    prefill_attention = staticmethod(prefill_attention)  # (q, k, v, scale): PyTorch causal SDPA, not a decode op
    verify_greedy = staticmethod(verify_greedy)  # (tokens, parents, target_argmax, max_depth)

    @staticmethod
    def argmax(logits):  # [..., V] -> [...] int64
        """``logits.argmax(-1)``: one reduction kernel on the GPU (``TorchOps.argmax`` has the CPU's C one)."""
        return logits.argmax(-1)

    verify_sampling = staticmethod(verify_sampling)  # (tokens, parents, probs, uniforms, exp_noise, max_depth)
    verify_chain = staticmethod(verify_chain)  # (tokens, probs, draft_probs, uniforms, exp_noise)
    kv_compact = staticmethod(kv_compact)  # (k_cache, v_cache, start, nodes)
