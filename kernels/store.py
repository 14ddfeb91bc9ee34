"""The per-device kernel-config store: vLLM-style JSON files, nearest-bucket lookup, cached.

One file per (op, shape keys, device, dtype), named as vLLM names its fused-MoE configs::

    rms_norm,device_name=NVIDIA_H200,dtype=bfloat16.json
    tree_attention,device_name=NVIDIA_H200,dtype=bfloat16.json

Content: the bucket -> config map plus the provenance the file is checked against::

    {"op": "rms_norm", "bucket": "hidden_size", "device_name": "NVIDIA_H200",
     "compute_capability": [9, 0], "dtype": "bfloat16",
     "versions": {"tritonspec": "0.1.0", "triton": "3.6.0", "torch": "2.11.0"},
     "configs": {"4096": {"num_warps": 8}, "8192": {"num_warps": 16}},
     "timings_us": {"4096": {"default": 5.1, "best": 4.2}}}

Lookup (``tuned``) takes the bucket nearest to the runtime value (ties to the smaller one).
Each op's bucket is chosen so tuning cannot break batch invariance: the reduction kernels
(RMSNorm, the fused gather, tree attention) are keyed on the hidden size / head_dim, never on
a row count (ARCHITECTURE §3).

Folders searched: ``$TRITONSPEC_TUNED_DIR`` alone when set; otherwise the user folder
(``$TRITONSPEC_CACHE/tuned``, default ``~/.cache/tritonspec/tuned``; ``tritonspec autotune``
writes there) and then the configs shipped in ``tritonspec/kernels/configs/``. A missing
file, a corrupt one, or one stamped for another GPU, compute capability, Triton or tritonspec
version gives one warning (``TunedConfigWarning``) and the launcher's heuristic default, never
an error. A different torch major.minor is only noted (Triton kernels do not depend on it).

Lookups are memoised per (op, shape, dtype, device, bucket value): after the first launch of a
shape a lookup is one dict access, with no file I/O.

This module is the one owner of the format: the kernel launchers read it (``tuned``) and
``tritonspec autotune kernels`` writes it (``make_table``, ``write_table``, ``forced``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

SHIPPED_DIR = Path(__file__).resolve().parent / "configs"
ENV_DIR = "TRITONSPEC_TUNED_DIR"


class TunedConfigWarning(UserWarning):
    """A tuned-config file is missing, corrupt or stamped for another device/version."""


# ------------------------------------------------------------------------------------------ naming
def device_name(device: torch.device | str | None = None) -> str:
    """``torch.cuda.get_device_name`` with spaces -> ``_`` (vLLM's spelling), or ``"cpu"``."""
    device = torch.device(device) if device is not None else _default_device()
    if device.type != "cuda":
        return "cpu"
    key = device.index if device.index is not None else torch.cuda.current_device()
    name = _NAMES.get(key)
    if name is None:
        name = _NAMES[key] = torch.cuda.get_device_name(key).replace(" ", "_")
    return name


def compute_capability(device: torch.device | str | None = None) -> list[int] | None:
    device = torch.device(device) if device is not None else _default_device()
    if device.type != "cuda":
        return None
    return list(torch.cuda.get_device_capability(device))


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def config_filename(op: str, device_name: str, dtype: str, shape: dict[str, Any] | None = None) -> str:
    """``<op>,<k>=<v>...,device_name=<GPU>,dtype=<dt>.json`` (shape keys in the given order)."""
    keys = "".join(f",{k}={v}" for k, v in (shape or {}).items())
    return f"{op}{keys},device_name={device_name},dtype={dtype}.json"


@functools.cache
def package_version() -> str:
    """The installed tritonspec version (``tritonspec.__version__``), ``"0+unknown"`` when the
    package metadata is missing (a source tree that was never installed)."""
    try:
        return importlib.metadata.version("tritonspec")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def versions() -> dict[str, str]:
    try:
        import triton

        tv = triton.__version__
    except ImportError:  # pragma: no cover
        tv = "none"
    return {"tritonspec": package_version(), "triton": tv, "torch": torch.__version__.split("+")[0]}


def search_dirs() -> list[Path]:
    """Folders looked up, first match wins (see the module docstring)."""
    env = os.environ.get(ENV_DIR)
    if env:
        return [Path(env)]
    return [user_dir(), SHIPPED_DIR]


def cache_base() -> Path:
    """The user cache every tritonspec cache lives under: ``$TRITONSPEC_CACHE``, else
    ``~/.cache/tritonspec`` (tuned configs, converted GGUF targets, built CPU kernels)."""
    cache = os.environ.get("TRITONSPEC_CACHE")
    return Path(cache) if cache else Path.home() / ".cache" / "tritonspec"


def user_dir() -> Path:
    """Where ``tritonspec autotune`` writes by default (``$TRITONSPEC_TUNED_DIR`` when set)."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env)
    return cache_base() / "tuned"


# ------------------------------------------------------------------------------------------ files
def make_table(
    op: str,
    bucket: str,
    configs: dict[int, dict],
    *,
    dtype: str,
    device: torch.device | str | None = None,
    timings_us: dict[int, dict] | None = None,
    name: str | None = None,
) -> dict:
    """A store file's content, stamped with this machine's GPU, capability and versions."""
    return {
        "op": op,
        "bucket": bucket,
        "device_name": name or device_name(device),
        "compute_capability": compute_capability(device) if name is None else None,
        "dtype": dtype,
        "versions": versions(),
        "configs": {str(k): v for k, v in sorted(configs.items())},
        "timings_us": {str(k): v for k, v in sorted((timings_us or {}).items())},
    }


def write_table(table: dict, out_dir: str | Path, shape: dict[str, Any] | None = None) -> Path:
    """Write (merge into) ``<out_dir>/<vLLM-style name>``; existing buckets of other sizes are kept."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / config_filename(table["op"], table["device_name"], table["dtype"], shape)
    if path.exists():
        try:
            old = json.loads(path.read_text())
            if _mismatch(old, table["device_name"], table["compute_capability"]) is None:
                table = dict(
                    table,
                    configs={**old.get("configs", {}), **table["configs"]},
                    timings_us={**old.get("timings_us", {}), **table["timings_us"]},
                )
        except (OSError, ValueError):
            pass  # a corrupt file is replaced
    path.write_text(json.dumps(table, indent=2) + "\n")
    clear_cache()
    return path


def _mismatch(table: dict, name: str, capability: list[int] | None) -> str | None:
    """Why ``table`` must not be used on this machine (hard mismatch), or None."""
    if not isinstance(table, dict) or not isinstance(table.get("configs"), dict):
        return "no 'configs' map"
    if table.get("device_name") != name:
        return f"tuned on {table.get('device_name')!r}, this device is {name!r}"
    cap = table.get("compute_capability")
    if capability is not None and cap is not None and list(cap) != list(capability):
        return f"tuned for compute capability {cap}, this device has {capability}"
    have, want = table.get("versions") or {}, versions()
    if have.get("tritonspec") != want["tritonspec"]:
        return f"tuned with tritonspec {have.get('tritonspec')}, this is {want['tritonspec']}"
    if _minor(have.get("triton")) != _minor(want["triton"]):
        return f"tuned with Triton {have.get('triton')}, this is Triton {want['triton']}"
    return None


def _minor(v: str | None) -> tuple[str, ...]:
    return tuple((v or "").split(".")[:2])


# ------------------------------------------------------------------------------------------ lookup
_NAMES: dict[int, str] = {}
_TABLES: dict[tuple, dict | None] = {}  # (dirs, filename) -> usable table or None
_RESOLVED: dict[tuple, dict] = {}  # (op, shape, dtype, device, value, defaults) -> config
_WARNED: set[str] = set()
_FORCED: dict[str, dict] = {}


@contextmanager
def forced(op: str, config: dict):
    """Launches of ``op`` inside the block use ``config`` (how the tuner times a candidate
    through the real launcher). Not thread-safe; tuning only."""
    _FORCED[op] = dict(config)
    try:
        yield
    finally:
        _FORCED.pop(op, None)


def clear_cache() -> None:
    """Forget loaded files and resolved lookups (after writing files, or in tests)."""
    _TABLES.clear()
    _RESOLVED.clear()
    _WARNED.clear()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, TunedConfigWarning, stacklevel=4)


def load_table(
    op: str, dtype: str, name: str, capability: list[int] | None, shape: dict[str, Any] | None = None
) -> dict | None:
    """The first usable table for this op/device/dtype in ``search_dirs()``, else None (warned once)."""
    dirs = tuple(search_dirs())
    fname = config_filename(op, name, dtype, shape)
    key = (dirs, fname)
    if key in _TABLES:
        return _TABLES[key]
    table, seen = None, False
    for d in dirs:
        path = d / fname
        if not path.is_file():
            continue
        seen = True
        try:
            cand = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            _warn_once(f"ignoring the corrupt tuned-config file {path} ({e}); using the heuristic default")
            continue
        why = _mismatch(cand, name, capability)
        if why is not None:
            _warn_once(
                f"ignoring the tuned-config file {path}: {why}; using the heuristic default "
                "(re-run `tritonspec autotune kernels`)"
            )
            continue
        have, want = (cand.get("versions") or {}).get("torch"), versions()["torch"]
        if _minor(have) != _minor(want):
            _warn_once(f"{path} was tuned with torch {have} (this is {want}); using it anyway")
        table = cand
        break
    if not seen and name != "cpu":  # the CPU (interpreter) is a test tool: no files expected there
        _warn_once(
            f"no tuned {op} configs for {name} ({dtype}) in {', '.join(map(str, dirs))}; using the "
            "heuristic default (run `tritonspec autotune kernels` to tune this GPU)"
        )
    _TABLES[key] = table
    return table


def config_problem(stored: Any, default: dict) -> str | None:
    """Why a stored config cannot be launched with ``default``'s integer keys, or None: each must be
    a positive int, and a power of two for tiles (``BLOCK_*``) and ``num_warps``."""
    if not isinstance(stored, dict):
        return "not a mapping"
    for k, v in default.items():
        if not isinstance(v, int):
            continue
        s = stored.get(k, v)
        if not isinstance(s, int) or isinstance(s, bool) or s <= 0:
            return f"{k}={s!r} is not a positive integer"
        if (k.startswith("BLOCK") or k == "num_warps") and s & (s - 1):
            return f"{k}={s} is not a power of two"
    return None


def nearest_bucket(keys: list[str] | dict, value: int) -> str | None:
    """The numeric key nearest to ``value`` (ties to the smaller key); None if there are none."""
    best = None
    for k in keys:
        try:
            kv = int(k)
        except (TypeError, ValueError):
            continue
        if best is None or (abs(kv - value), kv) < (abs(best[0] - value), best[0]):
            best = (kv, k)
    return None if best is None else best[1]


def tuned(
    op: str,
    value: int,
    default: dict,
    *,
    dtype: torch.dtype | str | None,
    device: torch.device | str | None,
    shape: dict[str, Any] | None = None,
) -> dict:
    """``default`` updated with the stored config of the bucket nearest ``value``.

    Only the keys of ``default`` are taken from the file, and only positive integer values, powers
    of two for tiles (``BLOCK_*``) and ``num_warps`` as Triton requires; a stored config with
    anything else is ignored (warned once). ``dtype=None`` or ``device=None``:
    the default (no lookup) — callers without a tensor at hand keep the heuristic.
    """
    if _FORCED and op in _FORCED:  # inside ``forced(...)``: the tuner timing a candidate
        return {**default, **_FORCED[op]}
    if dtype is None or device is None:
        return default
    key = (op, value, dtype, device, shape and tuple(shape.items()), tuple(default.items()))
    hit = _RESOLVED.get(key)
    if hit is not None:
        return hit
    dev, dt = torch.device(device), dtype_name(dtype)
    name = device_name(dev)
    table = load_table(op, dt, name, compute_capability(dev), shape)
    cfg = default
    if table is not None:
        b = nearest_bucket(table["configs"], int(value))
        if b is not None:
            stored = table["configs"][b]
            why = config_problem(stored, default)
            if why is None:
                cfg = {**default, **{k: stored[k] for k in default if k in stored}}
            else:
                _warn_once(f"ignoring the malformed tuned {op} config {stored!r} (bucket {b}) for {name}: {why}")
    _RESOLVED[key] = cfg
    return cfg
