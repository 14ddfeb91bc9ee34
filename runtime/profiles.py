"""Tuned draft-tree profiles: which ``SpecConfig`` a target + drafter pair runs on this device.

``tritonspec autotune tree`` writes one JSON file per (target, drafter, device, dtype, backend)
into the tuned-config folder (``store.search_dirs()``)::

    tree_shape,target=3f2a9c01d4e7,drafter=91b0c2aa5e13,device_name=NVIDIA_H200,dtype=bfloat16,backend=triton.json

This module owns the file's schema for both sides: ``write_profile`` (called by the tuner,
``autotune/tree_tuner.py``) and ``read_profile``. A profile holds ``kind``, the identity it was
tuned for (``target``, ``drafter``, ``device_name``, ``dtype``, ``backend``), provenance
(``versions``, ``threads``, ``created``), ``spec`` (the shape the runtime runs) and the tuner's
evidence, kept for people, not read back: ``predicted``, ``measured_with``, ``costs``,
``acceptance``, ``checks``.

``SpeculativeRuntime(spec=None)`` calls ``tuned_spec`` and runs the profile's shape when one
matches, else ``SpecConfig()``. Models are identified by content, not by path: a fingerprint of
the config fields that set the shapes and a few weight slices (rounded to bfloat16, so the
same checkpoint loaded in float32 or bfloat16 hashes alike). On a CPU the device name carries
the CPU model (``cpu-<model>``): a CPU's cost ratios are its own.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import warnings
from functools import cache
from pathlib import Path
from typing import Any

import torch

from ..kernels import store
from .config import SpecConfig

KIND = "tree_shape"


def _digest(parts: list[Any], tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode())
    for t in tensors:
        h.update(t.detach().to(device="cpu", dtype=torch.bfloat16).float().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def target_fingerprint(target: Any) -> str:
    """Content id of a ``TargetModel`` (shape-setting config fields + weight slices)."""
    parts = [
        target.arch,
        target.num_layers,
        target.hidden_size,
        target.vocab_size,
        target.num_heads,
        target.num_kv_heads,
        target.head_dim,
    ]
    last = target.layers[-1]
    return _digest(parts, [target.embed[:4, :32], target.lm_head[-4:, :32], last.down[:4, :32], last.wq[-4:, :32]])


def drafter_fingerprint(drafter: Any) -> str:
    """Content id of an ``Eagle3Drafter``."""
    c = drafter.config
    parts = [
        c.hidden_size,
        c.vocab_size,
        c.draft_vocab_size,
        c.fc_norm,
        c.norm_output,
        c.norm_before_fc,
        list(c.aux_layer_ids or []),
    ]
    return _digest(parts, [drafter.fc.weight[:4, :32], drafter.fc.weight[-4:, -32:], drafter.lm_head.weight[-4:, :32]])


@cache
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return re.sub(r"[^A-Za-z0-9]+", "_", line.split(":", 1)[1].strip()).strip("_")
    except OSError:
        pass
    import platform

    return re.sub(r"[^A-Za-z0-9]+", "_", platform.machine() or "unknown")


def device_key(device: torch.device | str) -> str:
    device = torch.device(device)
    return store.device_name(device) if device.type == "cuda" else f"cpu-{_cpu_model()}"


def profile_name(target_fp: str, drafter_fp: str, device_key: str, dtype: str, backend: str) -> str:
    """The profile file name (one spelling for the writer, ``write_profile``, and the reader)."""
    shape = {"target": target_fp, "drafter": drafter_fp}
    return store.config_filename(KIND, device_key, dtype, shape)[:-5] + f",backend={backend}.json"


def profile_filename(
    target_fp: str, drafter_fp: str, device: torch.device | str, dtype: torch.dtype | str, backend: str
) -> str:
    return profile_name(target_fp, drafter_fp, device_key(device), store.dtype_name(dtype), backend)


def find_profile(target: Any, drafter: Any, backend: str) -> Path | None:
    """The first profile file for this pair/device/dtype/backend in ``store.search_dirs()``."""
    name = profile_filename(
        target_fingerprint(target), drafter_fingerprint(drafter), target.device, target.dtype, backend
    )
    for d in store.search_dirs():
        if (d / name).is_file():
            return d / name
    return None


def _spec_fields(spec: SpecConfig) -> dict[str, int]:
    """The ``spec`` entry of a profile (``read_profile`` builds the ``SpecConfig`` back from it)."""
    return {
        "num_speculative_tokens": spec.num_speculative_tokens,
        "top_k": spec.top_k,
        "num_draft_tokens": spec.num_draft_tokens,
    }


def write_profile(
    out_dir: str | Path | None,
    key: dict[str, str],
    spec: SpecConfig,
    *,
    predicted: dict,
    measured_with: dict,
    costs: dict,
    acceptance: dict,
    checks: list[dict],
) -> Path:
    """Write the profile that runs ``spec`` for ``key`` into ``out_dir`` (default ``store.user_dir()``).

    ``key``: ``target`` and ``drafter`` fingerprints, ``device`` (``device_key``), ``dtype`` and
    ``backend`` names. The other arguments are the tuner's evidence (JSON-serialisable), stored
    as given. Returns the file's path."""
    out = Path(out_dir) if out_dir is not None else store.user_dir()
    out.mkdir(parents=True, exist_ok=True)
    name = profile_name(key["target"], key["drafter"], key["device"], key["dtype"], key["backend"])
    data = {
        "kind": KIND,
        "target": key["target"],
        "drafter": key["drafter"],
        "device_name": key["device"],
        "dtype": key["dtype"],
        "backend": key["backend"],
        "versions": store.versions(),
        "threads": torch.get_num_threads(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "spec": _spec_fields(spec),
        "predicted": predicted,
        "measured_with": measured_with,
        "costs": costs,
        "acceptance": acceptance,
        "checks": checks,
    }
    path = out / name
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def read_profile(path: str | Path) -> dict:
    """A profile's data (``write_profile``); ValueError unless it is a tree-shape profile with a valid ``spec``."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("kind") != KIND or not isinstance(data.get("spec"), dict):
        raise ValueError("not a tree-shape profile")
    SpecConfig(**data["spec"])  # validates
    return data


def tuned_spec(target: Any, drafter: Any, backend: str) -> SpecConfig | None:
    """The tuned ``SpecConfig`` for this target + drafter on this device and backend, or None.

    A corrupt or invalid profile is ignored with a warning; no profile is silent (the default
    shape is the documented behaviour)."""
    if drafter is None:
        return None
    try:
        path = find_profile(target, drafter, backend)
    except Exception as e:  # noqa: BLE001 - a lookup must never break model loading
        warnings.warn(
            f"tuned tree profile lookup failed ({e}); using the default SpecConfig",
            store.TunedConfigWarning,
            stacklevel=3,
        )
        return None
    if path is None:
        return None
    try:
        return SpecConfig(**read_profile(path)["spec"])
    except (OSError, ValueError, TypeError) as e:
        warnings.warn(
            f"ignoring the tuned tree profile {path} ({e}); using the default SpecConfig",
            store.TunedConfigWarning,
            stacklevel=3,
        )
        return None
