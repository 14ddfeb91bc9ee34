"""Our own compact forward for Llama-family targets (Llama, Mistral, Qwen2, Qwen3).

The adapter owns a static KV cache ``[L, B_max, S+1, Hkv, D]`` (slot S is a trash slot for
writes that must go nowhere), writes new tokens at caller-given slots, attends with a tree
mask over ``prefix + tree`` (``kernels.tree_attention``), and captures the residual stream at
the aux boundaries the drafter needs.

Boundary convention (one convention everywhere): boundary ``b`` is the residual stream
*entering* layer ``b``; 0 = embedding output, N = final-layer output before the final norm.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..kernels import cpu_linear as _cpu_linear
from ..kernels import cpu_target as _cpu_target
from .deterministic import DeterministicOps
from .errors import UserError
from .metadata import AttentionMetadata
from .ops import TorchOps
from .rope import Rope, rope_parameters
from .weights import load_state_dict

if TYPE_CHECKING:
    from .ops import Ops

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


DEFAULT_MAX_POSITIONS = 4096  # a config without max_position_embeddings (transformers' Llama default)


def target_info(config: Any) -> dict:
    """What a drafter keeps of its target's config: ``max_position_embeddings`` and the rope
    settings (checked when the drafter is exported)."""
    return {
        "max_position_embeddings": getattr(config, "max_position_embeddings", DEFAULT_MAX_POSITIONS),
        "rope": rope_parameters(config),
    }


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` that this machine has (a ``UserError`` otherwise, rather than
    torch's ``AssertionError: Torch not compiled with CUDA enabled`` at the first tensor)."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UserError(f"device={device!r} is not a device name: use 'cpu', 'cuda' or 'cuda:N'") from e
    if d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise UserError(f"device={str(device)!r}: no CUDA device is available here; use device='cpu'")
        if d.index is not None and d.index >= n:
            raise UserError(f"device={str(device)!r}: this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    return d


def expected_shapes(config: Any, arch: str) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """``({name: shape}, optional names)`` of a Llama-family checkpoint's tensors (``model.`` stripped)
    as the config describes them; optional: biases, tied ``lm_head``, Qwen3's q/k norms elsewhere."""
    H, V, I = config.hidden_size, config.vocab_size, config.intermediate_size
    nh = config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nh
    hd = getattr(config, "head_dim", None) or H // nh
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (V, H), "norm.weight": (H,), "lm_head.weight": (V, H)}
    optional = set() if not getattr(config, "tie_word_embeddings", False) else {"lm_head.weight"}
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        shapes.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
                a + "q_proj.weight": (nh * hd, H),
                a + "k_proj.weight": (nkv * hd, H),
                a + "v_proj.weight": (nkv * hd, H),
                a + "o_proj.weight": (H, nh * hd),
                a + "q_proj.bias": (nh * hd,),
                a + "k_proj.bias": (nkv * hd,),
                a + "v_proj.bias": (nkv * hd,),
                a + "o_proj.bias": (H,),
                a + "q_norm.weight": (hd,),
                a + "k_norm.weight": (hd,),
                m + "gate_proj.weight": (I, H),
                m + "up_proj.weight": (I, H),
                m + "down_proj.weight": (H, I),
            }
        )
        optional |= {a + f"{x}_proj.bias" for x in "qkvo"}
        if arch != "qwen3":
            optional |= {a + "q_norm.weight", a + "k_norm.weight"}
    return shapes, optional


def check_weights(config: Any, state: dict[str, torch.Tensor], arch: str) -> None:
    """Fail with a ``UserError`` naming the tensor when the weights disagree with the config: a layer
    count other than ``num_hidden_layers``, a missing or unexpected tensor, or a shape other than
    the config's (expected and found shapes in the message)."""
    layers = {int(k.split(".")[1]) for k in state if k.startswith("layers.") and k.split(".")[1].isdigit()}
    n = config.num_hidden_layers
    if layers and layers != set(range(n)):
        raise UserError(
            f"config.json says num_hidden_layers={n} but the weights hold layers "
            f"{_ranges(sorted(layers))}; fix num_hidden_layers or use the matching weights"
        )
    shapes, optional = expected_shapes(config, arch)
    missing = [k for k in shapes if k not in state and k not in optional]
    if missing:
        raise UserError(f"target weights lack {missing[:4]} (is this a {arch} checkpoint?)")
    unexpected = [k for k in state if k not in shapes and not k.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise UserError(
            f"target weights hold tensors a {arch} forward does not use: {unexpected[:4]} "
            "(a different architecture or extra modules this runtime would silently ignore)"
        )
    wrong = [
        f"{k}: expected {shapes[k]}, found {tuple(t.shape)}"
        for k, t in state.items()
        if k in shapes and tuple(t.shape) != shapes[k]
    ]
    if wrong:
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise UserError(f"target weights disagree with config.json: {'; '.join(wrong[:3])}{more}")


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default capture boundaries (2, N//2, N-3)."""
    return (2, num_layers // 2, num_layers - 3)


WEIGHT_LAYOUTS = ("auto", "nk", "kn", "amx", "panels")


def prepare_weight(w: torch.Tensor, layout: str) -> torch.Tensor:
    """``w [N, K]`` in the storage ``layout``: ``"nk"`` as loaded (row-major ``[N, K]``), ``"kn"``
    stored as ``[K, N]`` row-major and returned as its ``[N, K]`` transposed view. Same values, same
    shape: ``F.linear(x, w)`` then runs as ``x @ W_kn`` and, for the one-row decode step, streams
    the weights about twice as fast on a CPU (measured: issue 21, ``perf/bench_cpu_decode.py``).
    ``"amx"``: a bfloat16 weight with N % 16 == 0 and K % 32 == 0 packed into AMX tiles
    (``kernels.cpu_linear.pack_bf16``, 4-D; only the CPU kernel runs it), any other as loaded.
    ``"panels"``: a float32 or bfloat16 weight with N % 16 == 0 packed into 16-column panels
    (``kernels.cpu_linear.pack_panels``, 3-D; only the CPU kernel runs it; ``panels_pay`` says which),
    any other as loaded."""
    if layout == "amx":
        return _cpu_linear.pack_bf16(w) if _cpu_linear.packable(w) else w
    if layout == "panels":
        return _cpu_linear.pack_panels(w) if _cpu_linear.panels_pay(w) else w
    return w.t().contiguous().t() if layout == "kn" else w


def _linear(ops: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``ops.linear``, else ``F.linear`` (the CPU kernel for a packed weight)."""
    if ops is not None:
        return ops.linear(x, w)
    return _cpu_linear.cpu_linear(x, w) if _cpu_linear.is_packed(w) else F.linear(x, w)


@functools.cache
def cpu_has_bf16() -> bool | None:
    """Whether this CPU has bfloat16 dot-product instructions (AVX512-BF16 or AMX-BF16); None when
    it cannot be told (no ``/proc/cpuinfo``)."""
    flags = _cpu_linear.cpuinfo("flags")
    return None if flags is None else bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def resolve_layout(
    layout: str, device: torch.device, dtype: torch.dtype | None = torch.float32, cpu_linear: str = "auto"
) -> str:
    """``auto``: for bfloat16 on a CPU with AMX where the CPU kernels run, ``amx`` (weights packed
    into AMX tiles: a verify forward of 4-16 rows costs about one row, where AVX512-BF16 costs 1.3x
    at 4 rows and 2.3x at 8; one row streams as fast); for float32 and bfloat16 where the CPU kernels
    run where ``kernels.cpu_linear.panels_default(dtype)`` (AVX2; float32 on AVX-512), ``panels`` (16-column
    panels, the outer-product kernel: SmolLM2's float32 projections and head at 0.6-0.75x the ``[N, K]``
    kernel's time at 1-3 rows, ~0.7x at 6-16, ~0.5x from 64 rows, and faster than MKL up to 256;
    bfloat16 0.7-0.75x the bfloat16 ``[N, K]`` kernel's time at 1-3 rows and 0.75-0.95x at 4-128;
    perf/CPU_DECODE.md); else ``nk`` where the CPU linear
    kernel runs
    the dtype (``kernels.cpu_linear``), else ``kn`` for float32 on a CPU and ``nk`` otherwise.
    Measured in the model (SmolLM2, 2 threads, ``perf/bench_cpu_decode.py``): float32 plain steps
    cost the same in both layouts (30.1 vs 30.6 ms) and ``kn`` makes one-row-vs-many rounding
    differ only at 1 row (the deterministic mode pads less); bfloat16 is faster as loaded (33.9 vs
    39.9 ms)."""
    if layout not in WEIGHT_LAYOUTS:
        raise UserError(f"weight_layout={layout!r} is not one of {WEIGHT_LAYOUTS}")
    dtype = dtype or torch.float32
    if layout == "amx":
        why = (
            "it packs bfloat16 weights only"
            if dtype != torch.bfloat16 or device.type != "cpu"
            else _cpu_linear.amx_available()
        )
        if why is None and not _cpu_linear.enabled(dtype, cpu_linear):
            why = "the CPU kernels are off (cpu_linear='torch' or TRITONSPEC_CPU_LINEAR=torch)"
        if why is not None:
            raise UserError(f"weight_layout='amx' cannot run here: {why}; use 'auto' or 'nk'")
    if layout == "panels":
        on_cpu = dtype in _cpu_linear.DTYPES and device.type == "cpu"
        why = None if on_cpu else "it packs float32 and bfloat16 CPU weights only"
        if why is None and not _cpu_linear.enabled(dtype, cpu_linear):
            off = "the CPU kernels are off (cpu_linear='torch' or TRITONSPEC_CPU_LINEAR=torch)"
            why = _cpu_linear.available(dtype) or off
        if why is not None:
            raise UserError(f"weight_layout='panels' cannot run here: {why}; use 'auto' or 'nk'")
    if layout != "auto":
        return layout
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and _cpu_linear.enabled(dtype, cpu_linear):
        if dtype == torch.bfloat16 and _cpu_linear.amx_available() is None:
            return "amx"  # packed AMX tiles (kernels/cpu/linear.c): verify rows nearly free
        if _cpu_linear.panels_default(dtype):
            return "panels"  # the outer-product kernel on 16-column panels (kernels/cpu/linear.c)
        return "nk"  # kernels.cpu_linear streams [N, K] rows (and is row-invariant)
    return "kn" if device.type == "cpu" and dtype == torch.float32 else "nk"


@dataclass
class _Layer:
    """One decoder layer's weights. The q/k/v projections are one fused ``wqkv [Nq+Nk+Nv, K]``
    and gate/up one ``gate_up [2I, K]`` (one weight stream each, in ``TargetModel.weight_layout``);
    ``wq``/``wk``/``wv``/``gate``/``up`` are views into them."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor
    qkv_sizes: tuple[int, int, int]

    # [N, K] values (a copy when the weight is packed for AMX)
    @property
    def wq(self) -> torch.Tensor:
        return _cpu_linear.unpack(self.wqkv)[: self.qkv_sizes[0]]

    @property
    def wk(self) -> torch.Tensor:
        return _cpu_linear.unpack(self.wqkv)[self.qkv_sizes[0] : self.qkv_sizes[0] + self.qkv_sizes[1]]

    @property
    def wv(self) -> torch.Tensor:
        return _cpu_linear.unpack(self.wqkv)[self.qkv_sizes[0] + self.qkv_sizes[1] :]

    @property
    def gate(self) -> torch.Tensor:
        w = _cpu_linear.unpack(self.gate_up)
        return w[: w.shape[0] // 2]

    @property
    def up(self) -> torch.Tensor:
        w = _cpu_linear.unpack(self.gate_up)
        return w[w.shape[0] // 2 :]


def _architecture(config: Any) -> str:
    archs = list(getattr(config, "architectures", None) or [])
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[a]
    family = {v: v for v in SUPPORTED_ARCHITECTURES.values()}
    if not archs and getattr(config, "model_type", None) in family:
        return config.model_type
    raise UserError(
        f"unsupported target architecture {archs or getattr(config, 'model_type', None)!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


class TargetModel:
    """A Llama-family causal LM run by tritonspec's own forward.

    Examples
    --------
    >>> tm = TargetModel.from_pretrained("path/to/hf_model")            # doctest: +SKIP
    >>> tm.allocate_cache(max_batch_size=2, capacity=256)               # doctest: +SKIP
    """

    def __init__(
        self,
        config: Any,
        state: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        weight_layout: str = "auto",
    ):
        self.config = config
        self.weight_layout = resolve_layout(weight_layout, device, dtype)
        bf16_slow = device.type == "cpu" and dtype == torch.bfloat16 and cpu_has_bf16() is False
        why = _cpu_linear.available(torch.bfloat16) if bf16_slow else None  # with the CPU kernels bf16 is fast
        if why is not None:
            warnings.warn(
                "dtype=bfloat16 on a CPU without bf16 instructions (AVX512-BF16 / AMX) and without the CPU "
                f"kernels ({why}): matmuls convert to float32 on the fly, a slower path than float32 weights; "
                "pass dtype=torch.float32 for speed",
                stacklevel=3,
            )
        self.arch = _architecture(config)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UserError(f"target hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        self.device, self.dtype = device, dtype
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.vocab_size = config.vocab_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.max_position_embeddings = getattr(config, "max_position_embeddings", DEFAULT_MAX_POSITIONS)
        state = {k[len("model.") :] if k.startswith("model.") else k: v for k, v in state.items()}
        check_weights(config, state, self.arch)

        def get(name: str, required: bool = True) -> torch.Tensor | None:
            t = state.get(name)
            if t is None:
                if required:
                    raise UserError(f"target weights lack {name!r} (is this a {self.arch} checkpoint?)")
                return None
            return t.to(device=device, dtype=dtype)

        lay = self.weight_layout

        def fused(*names: str) -> torch.Tensor:
            """The named [N_i, K] weights as one prepared [sum N_i, K] weight (one copy at a time)."""
            return prepare_weight(torch.cat([get(n) for n in names]), lay)

        # the embedding keeps its values and shape; in "kn" it is stored [H, V] so the (tied) head
        # streams fast, and a row lookup reads one strided row per token (no second copy). In "amx"
        # and "panels" the embedding stays [V, H] for lookups and a tied head is its one packed copy.
        packs = lay in ("amx", "panels")
        self.embed = prepare_weight(get("embed_tokens.weight"), "nk" if packs else lay)
        self.norm = get("norm.weight")
        lm = state.get("lm_head.weight")
        tied = getattr(config, "tie_word_embeddings", False)
        if lm is None or tied:
            self.lm_head = prepare_weight(self.embed, lay) if packs else self.embed
        else:
            self.lm_head = prepare_weight(lm.to(device=device, dtype=dtype), lay)
        if lm is None and not tied:
            raise UserError("target weights lack 'lm_head.weight' and tie_word_embeddings is false")
        self.layers: list[_Layer] = []
        for i in range(self.num_layers):
            p = f"layers.{i}."
            a = p + "self_attn."
            biases = [get(a + f"{n}_proj.bias", False) for n in "qkv"]
            if any(b is not None for b in biases) and any(b is None for b in biases):
                raise UserError(f"target layer {i} has biases on some of q/k/v_proj only: give all three or none")
            self.layers.append(
                _Layer(
                    ln1=get(p + "input_layernorm.weight"),
                    ln2=get(p + "post_attention_layernorm.weight"),
                    wqkv=fused(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                    bqkv=torch.cat(biases) if biases[0] is not None else None,
                    wo=prepare_weight(get(a + "o_proj.weight"), lay),
                    bo=get(a + "o_proj.bias", False),
                    q_norm=get(a + "q_norm.weight", self.arch == "qwen3"),
                    k_norm=get(a + "k_norm.weight", self.arch == "qwen3"),
                    gate_up=fused(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=prepare_weight(get(p + "mlp.down_proj.weight"), lay),
                    qkv_sizes=(
                        self.num_heads * self.head_dim,
                        self.num_kv_heads * self.head_dim,
                        self.num_kv_heads * self.head_dim,
                    ),
                )
            )
        self.rope = Rope(config, self.head_dim, self.max_position_embeddings, device, dtype)
        self.aux_layer_ids: tuple[int, ...] = ()
        self.k_cache: torch.Tensor | None = None
        self.decode_lock = DecodeLock()  # one request at a time on this cache (runtimes may share it)
        self._native: tuple[Rope, _cpu_target.TargetWeights | None] | None = None  # (rope, weights): _native_weights
        self.v_cache: torch.Tensor | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        source: str | Path | Any,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        weight_layout: str = "auto",
    ) -> TargetModel:
        """From a Hugging Face model directory or a loaded ``transformers`` ``PreTrainedModel``.

        ``weight_layout``: how projection weights are stored (``prepare_weight``): ``"auto"`` (the
        fast one for the device), ``"kn"``, ``"nk"``, ``"amx"`` (bfloat16 on an AMX CPU: packed
        tiles, and a tied head's one extra copy) or ``"panels"`` (float32 or bfloat16 on a CPU where the
        kernels run, the default on AVX2 and for float32 on AVX-512: 16-column panels, and a tied
        head's one extra copy); values and
        results do not depend on it beyond the last bits of a matmul.

        Every tensor's shape is checked against the config (``check_weights``): a missing,
        unexpected or wrongly shaped tensor, or a layer count that disagrees with the weights, is a
        ``UserError`` naming the tensor."""
        device = resolve_device(device)
        if isinstance(source, (str, Path)):
            from transformers import AutoConfig

            path = Path(source)
            if not (path / "config.json").exists():
                raise FileNotFoundError(f"{path / 'config.json'} is missing: pass a Hugging Face model directory")
            try:
                config = AutoConfig.from_pretrained(str(path))
            except Exception as e:  # noqa: BLE001
                raise UserError(f"cannot read target config {path / 'config.json'}: {e}") from e
            _architecture(config)  # fail before reading weights
            state = load_state_dict(path)
        else:
            config = getattr(source, "config", None)
            if config is None or not hasattr(source, "state_dict"):
                raise UserError(
                    f"target must be a model directory or a transformers PreTrainedModel, got {type(source).__name__}"
                )
            _architecture(config)
            state = {k: v.detach() for k, v in source.state_dict().items()}
        if dtype is None:
            dtype = _config_dtype(config, device)
        elif not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise UserError(f"dtype={dtype!r} must be a floating torch dtype, e.g. torch.float32 or torch.bfloat16")
        return cls(config, state, device, dtype, weight_layout)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under their Hugging Face names, unfused, row-major ``[N, K]``, in the loaded
        dtype: what ``save_pretrained`` / export write, whatever ``weight_layout`` runs."""
        out = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        if not getattr(self.config, "tie_word_embeddings", False) and self.lm_head is not self.embed:
            out["lm_head.weight"] = _cpu_linear.unpack(self.lm_head)
        for i, L in enumerate(self.layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            out |= {
                p + "input_layernorm.weight": L.ln1,
                p + "post_attention_layernorm.weight": L.ln2,
                a + "q_proj.weight": L.wq,
                a + "k_proj.weight": L.wk,
                a + "v_proj.weight": L.wv,
                a + "o_proj.weight": _cpu_linear.unpack(L.wo),
                p + "mlp.gate_proj.weight": L.gate,
                p + "mlp.up_proj.weight": L.up,
                p + "mlp.down_proj.weight": _cpu_linear.unpack(L.down),
            }
            if L.bqkv is not None:
                bq, bk, bv = L.bqkv.split(L.qkv_sizes)
                out |= {a + "q_proj.bias": bq, a + "k_proj.bias": bk, a + "v_proj.bias": bv}
            extra = {"o_proj.bias": L.bo, "q_norm.weight": L.q_norm, "k_norm.weight": L.k_norm}
            out |= {a + name: t for name, t in extra.items() if t is not None}
        return {k: v.contiguous() for k, v in out.items()}

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (``state_dict()``: the original layout)."""
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(str(d))
        save_file(self.state_dict(), str(d / "model.safetensors"), metadata={"format": "pt"})
        return d

    def set_aux_layer_ids(self, ids: tuple[int, ...] | list[int]) -> None:
        """Capture the residual stream at these boundaries (0..N); a wrong id fails here."""
        ids = tuple(int(i) for i in ids)
        bad = [i for i in ids if not 0 <= i <= self.num_layers]
        if bad:
            raise UserError(
                f"aux layer ids {list(ids)} out of range for a target with {self.num_layers} layers: "
                f"boundary ids must lie in [0, {self.num_layers}] "
                f"(0 = embeddings, {self.num_layers} = last layer output)"
            )
        self.aux_layer_ids = ids

    def allocate_cache(self, max_batch_size: int, capacity: int) -> None:
        """Static KV cache for at least ``max_batch_size`` rows of ``capacity`` slots (+1 trash slot,
        always the last). It only grows: runtimes sharing this target keep the largest, so a cache
        (and the CUDA graphs that point at it) moves only when a caller needs more."""
        if self.rope.cos.shape[0] < capacity:
            self.rope = Rope(self.config, self.head_dim, capacity, self.device, self.dtype)
        c = self.k_cache
        if c is None or c.shape[1] < max_batch_size or c.shape[2] < capacity + 1:
            rows = max_batch_size if c is None else max(max_batch_size, c.shape[1])
            slots = capacity + 1 if c is None else max(capacity + 1, c.shape[2])
            shape = (self.num_layers, rows, slots, self.num_kv_heads, self.head_dim)
            self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
            self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        ops: Ops,
        tokens: torch.Tensor,  # [B, Q] int64
        meta: AttentionMetadata,
        capture_aux: bool = True,
        cache_row: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(final-normed hidden [B, Q, H], aux [B, Q, n_aux*H] or None)``.

        Row ``b`` reads and writes cache row ``cache_row + b`` (continuous batching prefills a
        newcomer into a finished row of the running batch).

        The tokens' K/V are written at ``meta.slots``; ``meta.prefill`` promises an empty prefix
        and a causal mask over left-aligned rows (padding last): attention then runs causally
        over the new K/V (``ops.prefill_attention``, a causal kernel that skips the masked half)
        instead of reading them back from the cache under a full mask.
        """
        assert self.k_cache is not None, "call allocate_cache() first"
        B, Q = tokens.shape
        ops.begin_forward(prompt=meta.prefill)
        aux_ids = self.aux_layer_ids if capture_aux else ()
        if not meta.prefill and meta.tree_mask is not None and not cache_row and (w := self._native_weights(ops)):
            out = _cpu_target.target_step(
                w, tokens, meta.positions, meta.slots, self.k_cache, self.v_cache, meta.prefix_lens, meta.tree_mask,
                self.eps, self.head_dim**-0.5, meta.kv_len, aux_ids,
            )  # fmt: skip
            if out is not None:
                return out
        h = F.embedding(tokens, self.embed)  # [B, Q, H]
        captured = {0: h} if 0 in aux_ids else {}
        scale = self.head_dim**-0.5
        rope = self.rope.tables(meta.positions)
        for i, L in enumerate(self.layers):
            x = ops.rms_norm(h, L.ln1, self.eps)
            q, k, v = ops.linear(x, L.wqkv, L.bqkv).split(L.qkv_sizes, dim=-1)
            q = q.view(B, Q, self.num_heads, self.head_dim)
            k = k.view(B, Q, self.num_kv_heads, self.head_dim)
            v = v.reshape(B, Q, self.num_kv_heads, self.head_dim).contiguous()  # kv_write: k's strides
            if L.q_norm is not None:
                q = ops.rms_norm(q, L.q_norm, self.eps)
                k = ops.rms_norm(k, L.k_norm, self.eps)
            q, k = ops.rope(q, *rope), ops.rope(k, *rope)
            kc, vc = self.k_cache[i], self.v_cache[i]
            if cache_row:  # an admitted row (continuous batching, eager): a view of its cache rows
                kc, vc = kc[cache_row:], vc[cache_row:]
                ops.kv_write(kc, vc, meta.slots, k, v)
            else:  # through the stacked cache: a compiled round updates it in place (kv_write_reference)
                ops.kv_write(self.k_cache, self.v_cache, meta.slots, k, v, layer=i)
            if meta.prefill:
                a = ops.prefill_attention(q, k, v, scale)
            else:
                a = ops.tree_attention(q, kc, vc, meta.prefix_lens, meta.tree_mask, scale, meta.kv_len)
            a = ops.linear(a.reshape(B, Q, self.num_heads * self.head_dim), L.wo, L.bo)
            x, h = ops.rms_norm(a, L.ln2, self.eps, residual=h)
            h = h + ops.linear(ops.silu_mul(ops.linear(x, L.gate_up)), L.down)
            if i + 1 in aux_ids:
                captured[i + 1] = h
        aux = torch.cat([captured[b] for b in aux_ids], dim=-1) if aux_ids else None
        return ops.rms_norm(h, self.norm, self.eps), aux

    # decode forwards as one C++ operator where it applies (False: the Python forward, the reference)
    native_step = True

    def _native_weights(self, ops: Ops) -> _cpu_target.TargetWeights | None:
        """The weights as ``kernels.cpu_target``'s operator takes them, where a decode forward runs on it: the
        torch backend itself (not a proxy that watches its calls; deterministic mode's where every op of the
        forward runs its row-invariant kernel, ``DeterministicOps.native_forward_ops``) with the CPU kernels on
        for this dtype, and weights it takes (``cpu_target.prepare``: float32 or bfloat16, projections packed into
        panels or, in bfloat16, AMX tiles; biases and Qwen3's q/k norms). Checked once per rope table (the cache's
        growth may replace it); None: the Python forward."""
        if not self.native_step:
            return None
        if type(ops) is DeterministicOps:  # where each op of its forward runs the kernel the operator calls
            ops = ops.native_forward_ops(self)
        if type(ops) is not TorchOps or not ops._cpu_kernel(self.dtype):
            return None
        key = self.rope
        cached = self._native
        if cached is None or cached[0] is not key:
            layers = [
                (L.ln1, L.wqkv, L.wo, L.ln2, L.gate_up, L.down, L.bqkv, L.bo, L.q_norm, L.k_norm) for L in self.layers
            ]
            heads = (self.num_heads, self.num_kv_heads, self.head_dim)
            w = _cpu_target.prepare(self.embed, layers, self.norm, self.rope.cos, self.rope.sin, heads)
            cached = self._native = (key, w)
        return cached[1]

    def drafter_info(self) -> dict:
        """What a drafter keeps of its target (``Eagle3Drafter.attach_target_embedding``)."""
        return target_info(self.config)

    def logits(self, hidden: torch.Tensor, ops: Any = None) -> torch.Tensor:
        """``[..., H] -> [..., V]`` float32 logits (argmax ties break to the lowest id); ``ops``: the
        backend whose ``linear`` runs the head (default ``F.linear``)."""
        return _linear(ops, hidden, self.lm_head).float()

    def greedy(self, hidden: torch.Tensor, ops: Any = None) -> torch.Tensor:
        """``[..., H] -> [...]`` argmax of the logits, without their float32 copy (the widening is
        exact, so the argmax and its lowest-id tie break are those of ``logits``). ``ops`` (an ``Ops``) runs
        it with its ``argmax`` (the torch backend: ``kernels.cpu_tree.argmax`` on the CPU; deterministic mode:
        on the caller's threads), each ``logits.argmax(-1)`` exactly."""
        logits = _linear(ops, hidden, self.lm_head)
        return logits.argmax(-1) if ops is None else ops.argmax(logits)


def _config_dtype(config: Any, device: torch.device) -> torch.dtype:
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    if device.type == "cpu":
        return torch.float32  # CPU BLAS is fastest and exact in fp32
    return d if isinstance(d, torch.dtype) else torch.bfloat16


class DecodeLock:
    """One request at a time on a target's decode state and KV cache (see the module docstring):
    another thread waits; the thread that holds it (an open stream) gets a ``UserError``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread that took it

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        me = threading.get_ident()
        if self._owner == me:  # waiting would deadlock: this thread's own open stream holds it
            raise UserError(
                "a stream of this runtime (or of a runtime sharing its target) is still open in this thread: "
                "iterate it to the end or call its close() before starting another generate() or stream()"
            )
        with self._lock:
            self._owner = me
            try:
                yield
            finally:
                self._owner = None
