"""Shared plumbing for the kernel modules: a guarded Triton import, argument checks, launch
options, and the pieces more than one kernel uses (the RMSNorm row math and config, the blockwise
argmax over a vocabulary and its config).

Importing a kernel module must work without Triton (the torch backend only needs the
references), so ``triton`` here is either the real package or a stub whose ``jit`` returns a
placeholder that raises when launched. ``tl.constexpr`` annotations are never evaluated at
import: the kernel modules use ``from __future__ import annotations`` and Triton reads the
annotation strings itself.

Floating-point fusion (part of the equivalence contract)
--------------------------------------------------------
Every launch passes ``enable_fp_fusion=ENABLE_FP_FUSION`` (``False``). With fusion on, the
compiler contracts ``a * b + c`` into one FMA (one rounding instead of two), so results depend
on the compiler's choices, differ between Triton releases (3.6 defaults to fusion on, 3.9 to
off) and differ from the interpreter (numpy, never fused) that the tests run. Off, every
multiply and add rounds like the PyTorch reference does, and the compiled kernels compute
what the tests checked. ``tests/test_compile_ptx.py`` compiles with the same flag.
"""

from __future__ import annotations

import torch

from .store import tuned

try:  # pragma: no cover - exercised by whichever environment runs the tests
    import triton
    import triton.language as tl

    HAS_TRITON = True
    _IMPORT_ERROR: ImportError | None = None
except ImportError as _e:  # pragma: no cover
    HAS_TRITON = False
    _IMPORT_ERROR = _e

    class _Unavailable:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            raise ImportError(f"{self.fn.__name__} needs triton ({_IMPORT_ERROR})")

    class _TritonStub:
        @staticmethod
        def jit(fn=None, **_kwargs):
            return _Unavailable(fn) if fn is not None else _Unavailable

    triton = _TritonStub()
    tl = None

ENABLE_FP_FUSION = False


def require_triton() -> None:
    if not HAS_TRITON:
        raise ImportError(f"the Triton launchers need the triton package ({_IMPORT_ERROR})")


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def check_tensor(
    name: str,
    t,
    *,
    dtypes: tuple[torch.dtype, ...] | None = None,
    ndim: int | None = None,
    shape: tuple[int | None, ...] | None = None,
    contiguous: bool = True,
    device: torch.device | None = None,
) -> None:
    """Raise a readable ``TypeError``/``ValueError`` that names ``name`` when ``t`` does not fit."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).removeprefix('torch.')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        if len(shape) != t.dim() or any(want is not None and want != got for want, got in zip(shape, t.shape)):
            want = tuple("*" if s is None else s for s in shape)
            raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)})")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_attention_inputs(
    q: torch.Tensor,  # [B, Q, Hq, D]
    k: torch.Tensor,  # [B_max, S, Hkv, D]
    v: torch.Tensor,  # [B_max, S, Hkv, D]
    prefix_lens: torch.Tensor | None = None,  # [B] int64
    tree_mask: torch.Tensor | None = None,  # [B, Q, T] bool
    names: tuple[str, str] = ("k_cache", "v_cache"),
) -> tuple[int, int, int, int, int]:
    """The attention kernels' shared argument checks (float q with a unit-stride head_dim, K/V caches of
    q's dtype and head_dim, whole GQA groups, enough cache rows, and the prefix lengths and tree mask
    when given); returns ``(B, Q, Hq, Hkv, D)``."""
    kn, vn = names
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=4, contiguous=False)
    if q.stride(-1) != 1 and q.shape[-1] > 1:
        raise ValueError(f"q must have unit stride along head_dim, got strides {q.stride()}")
    check_kv_cache(kn, k)
    check_kv_cache(vn, v)
    B, Q, hq, d = q.shape
    b_max, _, hkv, dk = k.shape
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{kn}/{vn} dtype ({k.dtype}, {v.dtype}) must equal q dtype {q.dtype}")
    if v.shape != k.shape:
        raise ValueError(f"{vn} shape {tuple(v.shape)} != {kn} shape {tuple(k.shape)}")
    if dk != d:
        raise ValueError(f"{kn} head_dim {dk} != q head_dim {d}")
    if hq % hkv:
        raise ValueError(f"q heads {hq} is not a multiple of the cache's KV heads {hkv}")
    if B > b_max:
        raise ValueError(f"q has {B} rows but the cache holds only {b_max}")
    if prefix_lens is not None:
        check_tensor("prefix_lens", prefix_lens, dtypes=(torch.int64,), shape=(B,), device=q.device)
    if tree_mask is not None:
        check_tensor("tree_mask", tree_mask, dtypes=(torch.bool,), ndim=3, contiguous=False, device=q.device)
        if tree_mask.shape[:2] != (B, Q):
            raise ValueError(f"tree_mask must have shape ({B}, {Q}, T), got {tuple(tree_mask.shape)}")
    return B, Q, hq, hkv, d


def check_kv_cache(name: str, cache: torch.Tensor, ndim: int = 4) -> None:
    """A float ``[..., Hkv, D]`` K/V tensor contiguous in its last two axes (any outer strides)."""
    check_tensor(name, cache, dtypes=FLOAT_DTYPES, ndim=ndim, contiguous=False)
    hkv, d = cache.shape[-2:]
    if cache.stride(-1) != 1 or cache.stride(-2) != d:
        raise ValueError(f"{name} must be contiguous in its last two axes [Hkv, D], got strides {cache.stride()}")


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """Round fp32 ``x`` to ``dtype`` to nearest, ties to even (IEEE), NaN kept as a quiet NaN.

    For bfloat16 the rounding is spelled out on the bits: the GPU's ``cvt.rn.bf16.f32`` gives
    the same bits, but Triton's interpreter truncates, and the tests run the interpreter.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        bits = tl.where(x != x, 0x7FC00000, bits)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


# --------------------------------------------------------------------------------------------
# RMSNorm row math, shared by ``rms_norm`` and the fused gather (``aux_gather`` with fc_norm),
# which must equal ``rms_norm`` bit for bit: same function, same config for the same H.
# --------------------------------------------------------------------------------------------
MAX_HIDDEN = 65536


def rms_config(hidden: int, dtype: torch.dtype | None = None, device: torch.device | None = None) -> tuple[int, int]:
    """``(BLOCK_H, num_warps)`` from the hidden size only (never the row count): the tuned
    num_warps for this GPU/dtype (``kernels.store``, nearest hidden size) when there is one,
    else the heuristic. Shared with the fused gather (bit-identical to this kernel under the
    interpreter; within a couple of ulps when compiled, see ``kernels/aux_gather.py``)."""
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} > {MAX_HIDDEN} is not supported by the RMSNorm kernel")
    block = max(next_pow2(hidden), 16)
    num_warps = 1 if block <= 256 else 4 if block <= 1024 else 8 if block <= 4096 else 16
    return block, tuned("rms_norm", hidden, {"num_warps": num_warps}, dtype=dtype, device=device)["num_warps"]


@triton.jit
def rms_normalize(h, w, H: tl.constexpr, eps, DTYPE: tl.constexpr):
    """fp32 ``w * round_DTYPE(h * rstd)`` for one fp32 row ``h`` (masked lanes must hold 0)."""
    ssq = tl.sum(h * h, axis=0)
    mean = tl.div_rn(ssq, tl.full([], H, tl.float32))
    rstd = tl.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(mean + eps))
    y = round_to(h * rstd, DTYPE)
    return w.to(tl.float32) * y.to(tl.float32)


# --------------------------------------------------------------------------------------------
# Blockwise passes over a vocabulary, shared by the sampling verifiers (tree and chain).
# --------------------------------------------------------------------------------------------
def sampling_config(vocab: int) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` for the passes over the vocabulary."""
    block = min(max(next_pow2(vocab), 16), 2048)
    return block, 1 if block <= 256 else 4 if block <= 1024 else 8


@triton.jit
def argmax_update(val, v0, best, best_v):
    """One block of a blockwise argmax over V: ``(best, best_v)`` after block ``val`` (starting at
    ``v0``); a strict comparison keeps the first maximal index across blocks, as torch.argmax."""
    block_best = tl.max(val, axis=0)
    block_v = v0 + tl.argmax(val, axis=0).to(tl.int64)
    better = block_best > best
    return tl.where(better, block_best, best), tl.where(better, block_v, best_v)
