"""Drafter checkpoints on disk: the three formats tritonspec reads and the two it writes.

Read: the official SafeAILab flat format (``LlamaForCausalLM`` config, ``midlayer.*``),
``LlamaForCausalLMEagle3`` (SpecForge/SGLang/vLLM) and the speculators format
(``Eagle3Speculator``, ``layers.0.*``). Every tensor is checked against the config (name,
expected and found shape), ``d2t`` against the vocabularies, and the switches are read with the
rules of the system that writes each format (``_config_from_dict``).

Written: ``format="eagle3"`` (``LlamaForCausalLMEagle3`` config + flat ``midlayer.*`` tensors)
and ``format="speculators"``, with the keys each serving system reads, in the convention it
applies (``runtime/serving.py`` holds the rules and their sources): the aux layer ids go to the
top level as boundary ids (vLLM reads them there, as they are) and to ``eagle_config`` as
post-layer ids (SGLang reads them there and adds 1). ``plan_export`` fills what a ``target``
knows (verifier name, rope, max positions, the official default aux ids) and judges the result
against the serving systems; ``write_checkpoint`` writes to a temporary directory and renames,
so a failure leaves the destination as it was.

This module works on configs and state dicts only; ``Eagle3Drafter.from_pretrained`` /
``save_pretrained`` (``runtime/drafter.py``) build and unpack the module around it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .drafter_config import DrafterConfig, legacy_rope_scaling
from .errors import UserError
from .rope import rope_parameters
from .serving import SYSTEMS, Report, compatibility, sglang_aux_ids
from .target import default_aux_layer_ids, target_info
from .weights import load_state_dict, read_config

FORMATS = ("eagle3", "speculators")
REPORT_FILE = "serving_compatibility.md"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")


@dataclass
class DrafterCheckpoint:
    """A drafter checkpoint read from disk: its config, its tensors under the flat names
    (``fc.weight``, ``midlayer.*``, ``d2t``, ``t2d``, ...) and its own embedding table, if any."""

    config: DrafterConfig
    state: dict[str, torch.Tensor]
    embed: torch.Tensor | None


def read_checkpoint(path: str | Path, aux_layer_convention: str = "auto") -> DrafterCheckpoint:
    """Read any supported drafter checkpoint directory (see ``Eagle3Drafter.from_pretrained``);
    a config that lacks a key, tensors whose shapes disagree with it and a ``d2t`` that maps
    outside the target vocabulary are ``UserError``s that name the key or tensor."""
    raw = read_config(path)
    if not isinstance(raw, dict):
        raise UserError(f"{path}/config.json is not a JSON object")
    state = load_state_dict(path)
    cfg = _config_from_dict(raw, state, aux_layer_convention, str(path))
    state = _canonical_keys(state)
    embed = state.pop("embed_tokens.weight", None)
    if "d2t" not in state:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise UserError(f"drafter checkpoint {path} has draft_vocab_size={cfg.draft_vocab_size} but no d2t")
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    check_tensors(cfg, state, str(path), embed=embed, optional=("t2d",))
    check_d2t(cfg, state["d2t"], str(path))
    if "t2d" not in state:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + state["d2t"].long()] = True
        state["t2d"] = t2d
    return DrafterCheckpoint(cfg, state, embed)


def check_tensors(
    cfg: DrafterConfig,
    state: dict[str, torch.Tensor],
    where: str,
    *,
    embed: torch.Tensor | None = None,
    optional: tuple[str, ...] = (),
) -> None:
    """Every tensor the config asks for is in ``state`` (but those named ``optional``) with the
    shape the config gives it; a ``UserError`` names each missing or misshapen tensor."""
    want = cfg.tensor_shapes()
    if embed is not None:
        state = {**state, "embed_tokens.weight": embed}
        want["embed_tokens.weight"] = (cfg.vocab_size, cfg.hidden_size)
    missing = [k for k in want if k not in state and k not in optional]
    if missing:
        raise UserError(
            f"drafter checkpoint {where} lacks {missing} (its config asks for them: fc_norm={cfg.fc_norm}, "
            f"norm_before_fc={cfg.norm_before_fc}, num_aux_hidden_states={cfg.num_aux_hidden_states})"
        )
    bad = [
        f"{k}: expected {list(want[k])}, found {list(v.shape)}"
        for k, v in state.items()
        if k in want and tuple(v.shape) != want[k]
    ]
    if bad:
        raise UserError(
            f"drafter checkpoint {where}: tensor shapes disagree with its config.json "
            f"(hidden_size={cfg.hidden_size}, intermediate_size={cfg.intermediate_size}, heads="
            f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}x{cfg.head_dim}, vocab {cfg.vocab_size}/"
            f"{cfg.draft_vocab_size}): " + "; ".join(bad)
        )


def check_d2t(cfg: DrafterConfig, d2t: torch.Tensor, where: str) -> None:
    """``d2t`` is an integer offset table whose targets ``i + d2t[i]`` lie in ``[0, vocab_size)``."""
    if d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise UserError(f"drafter checkpoint {where}: d2t has dtype {d2t.dtype}; it must be an integer offset table")
    targets = torch.arange(d2t.numel()) + d2t.long()
    bad = ((targets < 0) | (targets >= cfg.vocab_size)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise UserError(
            f"drafter checkpoint {where}: d2t maps {bad.numel()} draft ids outside the target vocabulary "
            f"[0, {cfg.vocab_size}) (draft id {i} -> {int(targets[i])}); the checkpoint's d2t does not belong "
            "to this vocabulary"
        )


# ---------------------------------------------------------------------------------------------- export
@dataclass
class ExportTarget:
    """What an export takes from the target model."""

    name_or_path: str
    architectures: list[str]
    num_layers: int
    hidden_size: int
    vocab_size: int
    info: dict  # max_position_embeddings and rope (runtime.target.target_info)


def resolve_target(target: Any) -> ExportTarget:
    """A target model directory, Hugging Face id, transformers config or loaded model, as an
    ``ExportTarget`` (a local directory is recorded by its absolute path)."""
    name = ""
    config = target
    if isinstance(target, (str, Path)):
        local = Path(target)
        name = str(local.resolve()) if local.is_dir() else str(target)
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(name)
        except Exception as e:  # noqa: BLE001 - transformers raises OSError/ValueError/HTTP errors
            raise UserError(
                f"target {str(target)!r} is neither a model directory with a config.json nor a loadable "
                f"Hugging Face model id ({type(e).__name__}: {e})"
            ) from e
    elif not hasattr(target, "num_hidden_layers") and hasattr(target, "config"):
        config = target.config  # a loaded PreTrainedModel
    config = getattr(config, "get_text_config", lambda: config)() or config
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if getattr(config, k, None) is None]
    if missing:
        raise UserError(f"target {target!r}: its config lacks {missing}; pass a causal LM's directory or config")
    name = name or str(getattr(config, "_name_or_path", "") or getattr(config, "name_or_path", "") or "")
    return ExportTarget(
        name_or_path=name,
        architectures=list(getattr(config, "architectures", None) or []),
        num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        info=target_info(config),
    )


@dataclass
class ExportPlan:
    """What an export writes: the config (filled from the target), the target (the verifier the
    speculators format records), what was filled, and the compatibility report (None when no
    serving system was asked for)."""

    config: DrafterConfig
    target: ExportTarget | None
    filled: list[str] = field(default_factory=list)
    report: Report | None = None

    def refusals(self) -> list[str]:
        return self.report.refusals() if self.report else []


def serving_systems(serving: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """``"vllm"``, ``"sglang"``, ``"all"`` (or a tuple of them) as a tuple; None -> ()."""
    if serving is None:
        return ()
    names = (serving,) if isinstance(serving, str) else tuple(serving)
    out: list[str] = []
    for n in names:
        if n == "all":
            out += SYSTEMS
        elif n in SYSTEMS:
            out.append(n)
        else:
            raise UserError(f"serving system {n!r}: use one of {', '.join(SYSTEMS)} or 'all'")
    return tuple(dict.fromkeys(out))


def plan_export(
    config: DrafterConfig,
    format: str,
    *,
    target: Any = None,
    target_info: dict | None = None,
    serving: str | tuple[str, ...] | None = None,
) -> ExportPlan:
    """Decide what an export of ``config`` writes. ``target`` (a directory, HF id, config or
    model) fills ``max_position_embeddings``, the rope settings, the verifier name and, when the
    checkpoint records none (official EAGLE-3), the aux ids (2, N//2, N-3); without it
    ``target_info`` (the target the drafter ran with, if any) is only checked. ``serving`` adds
    the compatibility report of those systems (``runtime/serving.py``)."""
    if format not in FORMATS:
        raise UserError(f"format={format!r} is not one of {FORMATS}")
    c = replace(config, rope=dict(config.rope))
    filled: list[str] = []
    t = resolve_target(target) if target is not None else None
    if t is not None:
        if (t.hidden_size, t.vocab_size) != (c.target_hidden_size, c.vocab_size):
            raise UserError(
                f"target {t.name_or_path!r} has hidden_size={t.hidden_size}, vocab_size={t.vocab_size} but the "
                f"drafter was built for target_hidden_size={c.target_hidden_size}, vocab_size={c.vocab_size}: "
                "pass the target the drafter was trained for"
            )
        if c.aux_layer_ids is None:
            c.aux_layer_ids = default_aux_layer_ids(t.num_layers)
            filled.append(f"aux_layer_ids {list(c.aux_layer_ids)} (EAGLE's default (2, N//2, N-3), N={t.num_layers})")
        if c.max_position_embeddings != t.info["max_position_embeddings"]:
            filled.append(f"max_position_embeddings {c.max_position_embeddings} -> {t.info['max_position_embeddings']}")
            c.max_position_embeddings = t.info["max_position_embeddings"]
        if c.rope != t.info["rope"]:
            filled.append(f"rope {c.rope} -> {t.info['rope']}")
            warnings.warn(
                f"the drafter's rope settings {c.rope} differ from the target's {t.info['rope']}: the export "
                "records the target's, so the served drafter uses the target's positions",
                stacklevel=3,
            )
            c.rope = dict(t.info["rope"])
        if max(c.aux_layer_ids) > t.num_layers:
            raise UserError(f"aux layer ids {list(c.aux_layer_ids)} exceed the target's {t.num_layers} layers")
    else:
        if c.aux_layer_ids is None:
            raise UserError(
                "the drafter records no aux layer ids (config.aux_layer_ids is None; official SafeAILab "
                "EAGLE-3 checkpoints do not record them: the reference code captures boundaries (2, N//2, N-3) "
                "of the target's N layers): pass the target model with --target <target model directory or "
                "Hugging Face id> (Python: save_pretrained(..., target=...)) so that they can be filled"
            )
        if target_info is not None:
            tmax = target_info["max_position_embeddings"]
            if c.max_position_embeddings < tmax:
                raise UserError(
                    f"max_position_embeddings={c.max_position_embeddings} is below the target's {tmax}; "
                    "long prompts would be drafted with wrong positions (pass --target to fill it)"
                )
            if c.rope != target_info["rope"]:
                raise UserError(
                    f"drafter rope settings {c.rope} differ from the target's {target_info['rope']} "
                    "(pass --target to record the target's)"
                )
    systems = serving_systems(serving)
    report = None
    if systems:
        report = compatibility(
            c,
            format,
            systems,
            num_target_layers=t.num_layers if t else None,
            verifier=t.name_or_path if t else None,
        )
        report.notes += [f"filled from the target: {f}" for f in filled]
    return ExportPlan(c, t, filled, report)


def write_checkpoint(
    path: str | Path,
    config: DrafterConfig,
    state: dict[str, torch.Tensor],
    *,
    format: str,
    dtype: torch.dtype | None,
    default_dtype: torch.dtype,
    target_info: dict | None,
    target: Any = None,
    serving: str | tuple[str, ...] | None = None,
    force: bool = False,
    overwrite: bool | None = None,
) -> Path:
    """Validate and write a drafter checkpoint (``format``: eagle3 or speculators); ``dtype``
    converts the floating tensors (None: as they are, recorded as ``default_dtype``). ``target``,
    ``target_info`` and ``serving``: see ``plan_export``; an export that a requested serving
    system would load but run differently is refused unless ``force``. ``overwrite``: None
    replaces a previous drafter's files but refuses a directory holding another model, False
    refuses any non-empty directory, True replaces anything. The files are written to a
    temporary directory first, so a failure leaves ``path`` as it was."""
    plan = plan_export(config, format, target=target, target_info=target_info, serving=serving)
    if plan.refusals() and not force:
        raise UserError(
            f"refusing to export the {format} drafter: " + "; ".join(plan.refusals()) + ". Pass --force "
            "(Python: force=True) to write it anyway, or --for a system that loads it as trained"
        )
    c = plan.config
    state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    embed = state.pop("embed_tokens.weight", None)
    check_tensors(c, state, "to write", embed=embed)
    if embed is not None:
        state["embed_tokens.weight"] = embed
    if format == "speculators":
        state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()}
    body = json.dumps(_config_to_dict(c, format, dtype or default_dtype, plan.target), indent=2)
    files: dict[str, Callable[[Path], Any]] = {
        "model.safetensors": lambda p: save_file(state, str(p), metadata={"format": "pt"}),
        "config.json": lambda p: p.write_text(body),
    }
    if plan.report is not None:
        files[REPORT_FILE] = lambda p: p.write_text(plan.report.markdown())
    return _write_dir(Path(path), files, overwrite)


def _write_dir(out: Path, files: dict[str, Callable[[Path], Any]], overwrite: bool | None) -> Path:
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                raise UserError(f"{p} is a file, not a directory: pass a directory to write the drafter to")
            break
    existing = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if existing and overwrite is False:
        shown = ", ".join(existing[:4]) + (", ..." if len(existing) > 4 else "")
        raise UserError(
            f"{out} is not empty ({shown}): pass --overwrite (Python: overwrite=True) to replace the drafter "
            "files in it, or choose a new directory"
        )
    if existing and overwrite is None and (other := _other_model(out)):
        raise UserError(
            f"{out} holds another model ({other}); writing the drafter there would replace its config and "
            "weights: choose a new directory or pass overwrite=True"
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        raise UserError(f"cannot write the drafter to {out}: {e.strerror or e}") from e
    try:
        umask = os.umask(0o022)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary directory
        for name, write in files.items():
            write(tmp / name)
            os.chmod(tmp / name, 0o666 & ~umask)
        if existing:  # replace our files one by one (each rename is atomic), then drop stale weights
            for name in files:
                os.replace(tmp / name, out / name)
            for p in out.iterdir():
                if p.name not in files and p.name.endswith(_WEIGHT_SUFFIXES):
                    p.unlink()
        else:
            if out.exists():
                out.rmdir()
            os.replace(tmp, out)
    except OSError as e:
        raise UserError(f"could not write the drafter to {out}: {e.strerror or e}; {out} was left as it was") from e
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _other_model(out: Path) -> str:
    """A description of the non-drafter model whose config.json is in ``out`` ('' if none)."""
    cfg = out / "config.json"
    if not cfg.exists():
        return ""
    try:
        raw = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return "an unreadable config.json"
    if not isinstance(raw, dict):
        return "a config.json that is not a JSON object"
    archs = [str(a) for a in raw.get("architectures") or []]
    drafter = (
        "draft_vocab_size" in raw
        or "speculators_model_type" in raw
        or "tritonspec" in raw
        or any("eagle" in a.lower() for a in archs)
    )
    return "" if drafter else f"config.json with architectures {archs or '?'}"


# ---------------------------------------------------------------------------------------------- reading
def _canonical_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    legacy = {"aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1", "aux_norm_high": "fc_norm.2"}
    for k, v in state.items():
        if k.startswith("model."):
            k = k[len("model.") :]
        if k.startswith("layers.0."):
            k = "midlayer." + k[len("layers.0.") :]
        elif k.startswith("layers."):
            raise UserError(
                f"multi-layer drafters are not supported yet (found {k!r}); use a one-layer EAGLE-3 drafter"
            )
        for old, new in legacy.items():
            if k.startswith(old + "."):
                k = new + k[len(old) :]
        if k == "draft_id_to_target_id":
            k = "d2t"
        out[k] = v
    return out


def _has_fc_norm_tensors(state: dict) -> bool:
    return any("fc_norm." in k or "aux_norm_" in k for k in state)


def _config_from_dict(raw: dict, state: dict, convention: str, where: str) -> DrafterConfig:
    """The drafter config of a checkpoint's ``config.json``, read with the rules of the system that
    writes each format (``runtime/serving.py`` RULES):

    * speculators format (``Eagle3Speculator``; written by the speculators library): sizes come from
      ``transformer_layer_config``, whose keys equal to the layer class's defaults are omitted by that
      library (``to_diff_dict``) and so are filled from it; ``norm_before_residual`` missing is False
      (the library's default) with a warning, since vLLM's translation reads a missing key as True.
    * ``LlamaForCausalLMEagle3`` / official: ``fc_norm`` is ``fc_norm OR use_aux_norm`` (SGLang's
      rule; the legacy key is SGLang's), with a warning when the keys disagree; ``norm_before_fc``
      from ``eagle_config`` first (vLLM's order); a missing ``norm_before_residual`` is False (vLLM).
    * aux layer ids: the ``tritonspec`` record when present (written by us, boundary ids), else the
      top-level key (vLLM's), else ``eagle_config``'s (SGLang's); converted per ``convention``.
    * a missing ``fc_norm`` with ``fc_norm.*`` / ``aux_norm_*`` tensors present warns: read as
      False, as vLLM and SGLang do.
    """
    archs = [str(a) for a in raw.get("architectures") or []]
    spec = raw.get("speculators_model_type") == "eagle3" or "Eagle3Speculator" in archs
    eagle = raw.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise UserError(f"{where}/config.json: eagle_config is {type(eagle).__name__}, not an object")
    if spec:
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise UserError(f"{where}/config.json: a speculators-format config needs a transformer_layer_config object")
        layer = {**_layer_defaults(layer.get("model_type", "llama")), **layer}
    else:
        layer = raw

    def size(key: str, *sources: dict, default: Any = None) -> int:
        for src in sources or (layer,):
            if src.get(key) is not None:
                v = src[key]
                if isinstance(v, bool) or not isinstance(v, int):
                    raise UserError(f"{where}/config.json: {key}={v!r} is not an integer")
                return v
        if default is not None:
            return default
        raise UserError(
            f"{where}/config.json lacks {key!r}"
            + (" (in transformer_layer_config)" if spec else "")
            + ": it is not a complete EAGLE-3 drafter config"
        )

    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise UserError(
            f"{where}: multi-layer drafters (num_hidden_layers={layer['num_hidden_layers']}) are not supported yet"
        )
    hidden = size("hidden_size")
    heads = size("num_attention_heads")
    fc = state.get("fc.weight", state.get("model.fc.weight"))
    if fc is None:
        raise UserError(f"drafter checkpoint {where} has no fc.weight: is it an EAGLE-3 drafter?")
    if fc.ndim != 2:
        raise UserError(f"drafter checkpoint {where}: fc.weight has shape {list(fc.shape)}, expected 2 dimensions")
    target_hidden = size("target_hidden_size", raw, layer, default=hidden)
    n_aux = raw.get("num_aux_hidden_states", layer.get("num_aux_hidden_states") if spec else None)
    ids = _aux_ids(raw, eagle, where)
    if n_aux is None:
        n_aux = len(ids) if ids else fc.shape[1] // target_hidden
    if fc.shape[1] != n_aux * target_hidden:
        raise UserError(
            f"{where}: fc.weight takes {fc.shape[1]} inputs but {n_aux} aux states of target_hidden_size "
            f"{target_hidden} make {n_aux * target_hidden}"
        )
    if ids is not None:
        if convention not in ("auto", "boundary", "post_layer"):
            raise UserError(f"aux_layer_convention={convention!r}: use 'auto', 'boundary' or 'post_layer'")
        ours = raw.get("tritonspec") or {}
        if convention == "auto" and ours.get("aux_layer_convention") == "boundary":
            convention = "boundary"  # written by us: no guessing
        post = convention == "post_layer" or (convention == "auto" and ids[0] == 1)
        if post and convention == "auto":
            warnings.warn(
                f"{where}: aux layer ids {ids} start at 1, read as post-layer ids (+1, SGLang's rule); "
                "pass aux_layer_convention='boundary' if they are boundary ids",
                stacklevel=3,
            )
        ids = tuple(i + 1 for i in ids) if post else tuple(ids)
    flags = _read_flags(raw, layer, eagle, state, spec, where)
    vocab = size("vocab_size", layer, raw)
    try:
        return DrafterConfig(
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_attention_heads=heads,
            num_key_value_heads=size("num_key_value_heads", default=heads),
            head_dim=size("head_dim", default=hidden // heads),
            vocab_size=vocab,
            draft_vocab_size=size("draft_vocab_size", raw, default=vocab),
            target_hidden_size=target_hidden,
            num_aux_hidden_states=n_aux,
            rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
            max_position_embeddings=size("max_position_embeddings", default=2048),
            rope=rope_parameters(_Obj(layer)),
            aux_layer_ids=ids,
            bos_token_id=layer.get("bos_token_id"),
            eos_token_id=layer.get("eos_token_id"),
            **flags,
        )
    except UserError as e:
        raise UserError(f"{where}/config.json: {e}") from None


def _aux_ids(raw: dict, eagle: dict, where: str) -> list[int] | None:
    ours = raw.get("tritonspec") or {}
    for ids in (ours.get("aux_layer_ids"), raw.get("eagle_aux_hidden_state_layer_ids")):
        if ids is not None:
            break
    else:
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise UserError(f"{where}/config.json: eagle_aux_hidden_state_layer_ids={ids!r} is not a list of integers")
    return ids


def _read_flags(raw: dict, layer: dict, eagle: dict, state: dict, spec: bool, where: str) -> dict[str, bool]:
    def first(*pairs: tuple[dict, str]) -> Any:
        for src, key in pairs:
            if src.get(key) is not None:
                return src[key]
        return None

    if spec:
        fc_norm = first((raw, "fc_norm"), (layer, "fc_norm"))
        fc_norm_known = fc_norm is not None
        fc_norm = bool(fc_norm)
        residual = first((raw, "norm_before_residual"), (layer, "norm_before_residual"))
        if residual is None:
            warnings.warn(
                f"{where}: the speculators config has no norm_before_residual; read as false (the speculators "
                "library's default), but vLLM's translation (algos.update_eagle3) would serve it as true",
                stacklevel=4,
            )
        before_fc = first((raw, "norm_before_fc"), (layer, "norm_before_fc"))
        norm_output = first((raw, "norm_output"), (layer, "norm_output"))
    else:
        keys = {"fc_norm": raw.get("fc_norm"), "use_aux_norm": raw.get("use_aux_norm")}
        keys["eagle_config.fc_norm"] = eagle.get("fc_norm")
        present = {k: bool(v) for k, v in keys.items() if v is not None}
        fc_norm_known = bool(present)
        fc_norm = any(present.values())
        if len(set(present.values())) > 1:
            warnings.warn(
                f"{where}: the config's per-aux norm keys disagree ({present}); read as fc_norm=true, as SGLang "
                "does (fc_norm OR use_aux_norm); vLLM reads fc_norm only",
                stacklevel=4,
            )
        residual = raw.get("norm_before_residual")
        before_fc = first((eagle, "norm_before_fc"), (raw, "norm_before_fc"))
        norm_output = first((raw, "norm_output"), (eagle, "norm_output"), (eagle, "return_hidden_post_norm"))
    if not fc_norm_known and _has_fc_norm_tensors(state):
        warnings.warn(
            f"{where}: the checkpoint has fc_norm tensors but its config sets no fc_norm key; read as "
            "fc_norm=false, as vLLM and SGLang do (the tensors are ignored)",
            stacklevel=4,
        )
    return {
        "fc_norm": fc_norm,
        "norm_output": bool(norm_output),
        "norm_before_fc": bool(before_fc),
        "norm_before_residual": bool(residual),
    }


def _layer_defaults(model_type: str) -> dict:
    """The keys the speculators library omits from ``transformer_layer_config`` (its layer class's
    defaults: ``PretrainedConfig.to_diff_dict``)."""
    from transformers import AutoConfig

    try:
        d = AutoConfig.for_model(model_type).to_dict()
    except (KeyError, ValueError) as e:
        raise UserError(f"transformer_layer_config model_type={model_type!r} is unknown to transformers") from e
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    return {k: d[k] for k in (*keep, "rms_norm_eps", "max_position_embeddings", "rope_theta") if k in d}


class _Obj:
    def __init__(self, d: dict):
        self.__dict__.update(d)


# ---------------------------------------------------------------------------------------------- writing
def _config_to_dict(c: DrafterConfig, format: str, dtype: torch.dtype, target: ExportTarget | None) -> dict:
    layer = {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope.get("rope_theta", 10000.0),
        "rope_scaling": legacy_rope_scaling(c.rope),
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
    }
    switches = {
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        "norm_before_fc": c.norm_before_fc,
        "num_aux_hidden_states": c.num_aux_hidden_states,
    }
    flags = {
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        **switches,
        "norm_before_residual": c.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),  # vLLM: top level, boundary ids
    }
    ours = {"aux_layer_convention": "boundary", "aux_layer_ids": list(c.aux_layer_ids)}
    if format == "eagle3":
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            **layer,
            **flags,
            "eagle_config": {
                # SGLang reads the ids here only and adds 1 (post-layer convention)
                "eagle_aux_hidden_state_layer_ids": sglang_aux_ids(c.aux_layer_ids),
                "use_aux_hidden_state": True,
                "fc_norm": c.fc_norm,
                "norm_output": c.norm_output,
                "norm_before_fc": c.norm_before_fc,
            },
            "tritonspec": {**ours, "config": asdict(c) | {"aux_layer_ids": list(c.aux_layer_ids)}},
        }
    return {
        "architectures": ["Eagle3Speculator"],
        "model_type": "speculators",
        "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0",
        # vLLM copies these keys into the model config; the switches are repeated here because some
        # vLLM translations (algos.update_eagle3 @cfb173ab) do not forward them from the top level
        "transformer_layer_config": {**layer, **switches},
        **flags,
        "tritonspec": ours,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": target.name_or_path if target else None,
                "architectures": target.architectures if target else [],
            },
        },
    }
