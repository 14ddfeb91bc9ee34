"""Tuned draft-tree profiles: which shapes a target + drafter pair runs on this device.

``tritonspec autotune tree`` writes one JSON file per (target, drafter, device, dtype, backend,
rounds) into the tuned-config folder (``store.user_dir()``, or ``--out``)::

    tree_shape,target=3f2a9c01d4e7,drafter=91b0c2aa5e13,device_name=NVIDIA_H200,dtype=bfloat16,backend=triton.json
    tree_shape,target=...,device_name=cpu-x86_64-avx512,dtype=float32,backend=torch,rounds=compiled.json

``rounds=compiled`` (``autotune tree --compile``): measured with compiled CPU rounds
(``compile=True``), whose costs differ from eager rounds' (per-op overhead gone, so deeper chains
pay); a runtime with ``compile=True`` looks those up first and falls back to the eager ones.

This module owns the file's schema for both sides: ``write_profile`` (called by the tuner,
``autotune/tree_tuner.py``) and ``read_profile``. A profile holds ``kind``, the identity it was
tuned for (``target``, ``drafter``, ``device_name``, ``dtype``, ``backend``, ``rounds``), provenance
(``versions``, ``threads``, ``created``), ``spec`` (the batch-1 greedy shape), optionally
``shapes`` (the measured best shape per batch size and sampling mode: rows ``{"batch_size",
"sampling": "greedy"|"sampled", "spec": {...} or null for plain decoding}``, plus ``"context": T``
on rows measured on long prompts, which apply to prompts of at least T tokens) and the tuner's
evidence, kept for people, not read back: ``predicted``, ``measured_with``, ``costs``,
``acceptance``, ``checks``; and ``carried_over`` (``{"from_drafter", "note"}``) on a profile copied,
not re-measured, to a retrained drafter of the same architecture (the shipped SmolLM2 profiles of
device kinds the retraining session could not measure).

Lookup (``shape_policy``, called by ``SpeculativeRuntime(spec=None)``): the profile named for this
exact device (``device_key``: the GPU name, or ``cpu-<model>``) in the user folders
(``store.search_dirs()``), then in the profiles shipped with the package (``runtime/tuned/``),
then one named for this *kind* of device (``device_kind``: ``cpu-<arch>-<vector ISA>``, e.g.
``cpu-x86_64-avx512``, with ``_amx`` appended for a target whose bfloat16 weights run on AMX; a
GPU's compute capability, ``cuda-sm90``) in the same order. A corrupt or
invalid profile is skipped with a warning (``store.TunedConfigWarning``), as is a user profile
tuned by another tritonspec release (shipped ones belong to this release). No profile: the
rule of ``runtime/spec_policy.py``.

Models are identified by content, not by path: a fingerprint of the config fields that set the
shapes and a few weight slices (rounded to bfloat16, so the same checkpoint loaded in float32 or
bfloat16 hashes alike).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import warnings
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import torch

from ..kernels import store
from .adaptive import LAMBDAS, LONG_MIN_ROUNDS, ShapeLadder
from .config import SpecConfig
from .shape_model import AcceptanceProfile, CostModel
from .spec_policy import ShapePolicy

KIND = "tree_shape"
ROUNDS = ("eager", "compiled")  # how the decode rounds ran when a profile was measured
SHIPPED_DIR = Path(__file__).resolve().parent / "tuned"  # profiles shipped with the package
MODES = ("greedy", "sampled")


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
    from ..kernels.cpu_linear import is_packed, unpack

    # the [N, K] values whatever weight_layout stored: a packed weight's corner block unpacks to
    # rows 16 nb.., columns 32 kb.. (AMX) or a panel's first 32 columns (panels), not the whole head
    def corner(w: torch.Tensor, last_rows: bool) -> torch.Tensor:
        if not is_packed(w):
            return w
        blocks = w[-1:] if last_rows else w[:1]
        return unpack(blocks[:, :1] if w.dim() == 4 else blocks[:, :32].contiguous())

    head, down = corner(target.lm_head, True), corner(last.down, False)
    return _digest(parts, [target.embed[:4, :32], head[-4:, :32], down[:4, :32], last.wq[-4:, :32]])


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
    """The exact device a profile was measured on: the GPU's name, or ``cpu-<model name>``."""
    device = torch.device(device)
    return store.device_name(device) if device.type == "cuda" else f"cpu-{_cpu_model()}"


AMX_SUFFIX = "_amx"  # a CPU kind whose target runs AMX-packed bfloat16 weights (``weight_layout="amx"``)


def device_kind(device: torch.device | str, weight_layout: str | None = None) -> str:
    """The kind of device a profile applies to when no exact one exists: ``cpu-<arch>-<ISA>``
    (``torch.backends.cpu.get_cpu_capability()``: avx512, avx2, ...) or ``cuda-sm<cc>``. A target
    whose weights run on AMX (``weight_layout="amx"``) is its own kind, ``cpu-<arch>-<ISA>_amx``: AMX
    verifies 10 rows for ~1.4 one-row steps where AVX512-BF16 pays ~2.5, so the trees tuned on one
    are wrong for the other."""
    import platform

    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda-sm{major}{minor}"
    isa = torch.backends.cpu.get_cpu_capability().lower() + (AMX_SUFFIX if weight_layout == "amx" else "")
    return re.sub(r"[^a-z0-9_-]+", "_", f"cpu-{platform.machine().lower()}-{isa}")


def device_names(device: torch.device | str, weight_layout: str | None = None) -> tuple[str, str]:
    """(exact, kind): the device names a profile is written under (``autotune tree``, ``--device-kind``
    for the kind) and looked up by: ``device_key`` and ``device_kind``, both with ``AMX_SUFFIX`` for a
    CPU target whose weights run on AMX (``weight_layout="amx"``)."""
    amx = AMX_SUFFIX if weight_layout == "amx" and torch.device(device).type == "cpu" else ""
    return device_key(device) + amx, device_kind(device, weight_layout)


def profile_name(
    target_fp: str, drafter_fp: str, device_key: str, dtype: str, backend: str, rounds: str = "eager"
) -> str:
    """The profile file name (one spelling for the writer, ``write_profile``, and the reader).
    ``rounds``: ``"eager"`` (no suffix: the names of earlier releases) or ``"compiled"``."""
    if rounds not in ROUNDS:
        raise ValueError(f"rounds={rounds!r} is not one of {ROUNDS}")
    shape = {"target": target_fp, "drafter": drafter_fp}
    suffix = "" if rounds == "eager" else f",rounds={rounds}"
    return store.config_filename(KIND, device_key, dtype, shape)[:-5] + f",backend={backend}{suffix}.json"


def own_profile_names(target: Any, drafter: Any, backend: str, compiled: bool = False) -> list[str]:
    """The profile file names for this pair on this exact device, then on this kind of device
    (``compiled``: the compiled-rounds names first, then the eager ones)."""
    return _own_names(*_pair_key(target, drafter), _where(target), backend, compiled)


def _where(target: Any) -> tuple[Any, str | None]:
    """(device, weight layout): what a profile's device name is derived from (``device_kind``)."""
    return target.device, getattr(target, "weight_layout", None)


def _pair_key(target: Any, drafter: Any) -> tuple[str, str, str]:
    """(target fingerprint, drafter fingerprint, dtype name): what a profile name is keyed on besides the device."""
    return target_fingerprint(target), drafter_fingerprint(drafter), store.dtype_name(target.dtype)


def _own_names(t: str, d: str, dt: str, where: tuple, backend: str, compiled: bool = False) -> list[str]:
    return [n for m in _modes(compiled) for n in _names_for(t, d, dt, where, backend, m)]


def _names_for(t: str, d: str, dt: str, where: tuple, backend: str, rounds: str) -> list[str]:
    """This exact device's name, then this kind of device's, for one ``rounds`` mode (``where``:
    ``_where(target)``)."""
    return [profile_name(t, d, key, dt, backend, rounds) for key in device_names(*where)]


def _modes(compiled: bool) -> tuple[str, ...]:
    """The ``rounds`` modes a runtime reads, in lookup order."""
    return ("compiled", "eager") if compiled else ("eager",)


def candidate_profiles(target: Any, drafter: Any, backend: str, compiled: bool = False) -> list[Path]:
    """Every existing profile file for this pair/dtype/backend, in lookup order: this exact device's,
    then this kind of device's, then (a CPU) one of the same architecture with another vector ISA
    (e.g. an ``avx2`` profile on an ``avx512`` CPU: the cost ratios that pick a shape carry over
    better than the rule's); user folders (``store.search_dirs()``) before ``SHIPPED_DIR``.
    ``compiled`` (a runtime with compiled CPU rounds): that whole order for ``rounds=compiled``
    profiles first, then for the eager ones."""
    t, d, dt = _pair_key(target, drafter)  # fingerprinted once for every name below
    where = _where(target)
    kind = device_kind(*where)
    names = _own_names(t, d, dt, where, backend, compiled)
    dirs = [*store.search_dirs(), SHIPPED_DIR]
    found: list[Path] = []
    for mode in _modes(compiled):
        own = _names_for(t, d, dt, where, backend, mode)
        found += [folder / name for name in own for folder in dirs if (folder / name).is_file()]
        if kind.startswith("cpu-"):
            family = kind.rsplit("-", 1)[0] + "-"  # cpu-<arch>-
            pattern = profile_name(t, d, family + "*", dt, backend, mode)
            for folder in dirs:
                found += sorted(
                    p
                    for p in folder.glob(pattern)
                    if p not in found and p.name not in names and (kind.endswith(AMX_SUFFIX) or not _amx_name(p.name))
                )
    return found


def _amx_name(name: str) -> bool:
    """A profile file tuned on AMX-packed weights (its device name ends with ``AMX_SUFFIX``): its
    trees verify many rows, too many for a target without AMX, which never falls back to it."""
    return f"{AMX_SUFFIX},dtype=" in name


LOOKUP_FIELDS = ("prompt_lookup_num_tokens", "prompt_lookup_max", "prompt_lookup_min")  # written when a lookup runs


def _spec_fields(spec: SpecConfig) -> dict[str, int]:
    """The ``spec`` entry of a profile (``read_profile`` builds the ``SpecConfig`` back from it); the
    prompt-lookup fields only for a shape with a lookup branch (older readers see the same entries)."""
    fields = {
        "num_speculative_tokens": spec.num_speculative_tokens,
        "top_k": spec.top_k,
        "num_draft_tokens": spec.num_draft_tokens,
    }
    if spec.prompt_lookup_num_tokens:
        fields |= {name: getattr(spec, name) for name in LOOKUP_FIELDS}
    return fields


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
    shapes: list[dict] | None = None,
) -> Path:
    """Write the profile that runs ``spec`` for ``key`` into ``out_dir`` (default ``store.user_dir()``).

    ``key``: ``target`` and ``drafter`` fingerprints, ``device`` (``device_key``), ``dtype`` and
    ``backend`` names, optionally ``rounds`` (``"compiled"``; default ``"eager"``). ``shapes``: rows
    ``{"batch_size", "sampling", "spec": SpecConfig | None, ...evidence}`` (the measured best shape
    per batch size and mode). The other arguments are the tuner's evidence (JSON-serialisable),
    stored as given. Returns the file's path."""
    out = Path(out_dir) if out_dir is not None else store.user_dir()
    out.mkdir(parents=True, exist_ok=True)
    rounds = key.get("rounds", "eager")
    name = profile_name(key["target"], key["drafter"], key["device"], key["dtype"], key["backend"], rounds)
    data = {
        "kind": KIND,
        "target": key["target"],
        "drafter": key["drafter"],
        "device_name": key["device"],
        "dtype": key["dtype"],
        "backend": key["backend"],
        "rounds": rounds,
        "versions": store.versions(),
        "threads": torch.get_num_threads(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "spec": _spec_fields(spec),
        "shapes": [{**row, "spec": _spec_fields(row["spec"]) if row["spec"] else None} for row in shapes or []],
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
    """A profile's data (``write_profile``); ValueError unless it is a tree-shape profile whose
    ``spec`` and ``shapes`` rows are valid shapes (integers, as ``SpecConfig`` requires)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("kind") != KIND or not isinstance(data.get("spec"), dict):
        raise ValueError("not a tree-shape profile")
    _read_spec(data["spec"])
    for row in data.get("shapes") or []:
        if not isinstance(row, dict) or row.get("sampling") not in MODES:
            raise ValueError(f"bad shapes row {row!r}: needs batch_size, sampling (greedy|sampled), spec")
        b = row.get("batch_size")
        if type(b) is not int or b < 1:
            raise ValueError(f"bad shapes row {row!r}: batch_size must be an integer >= 1")
        t = row.get("context", 0)
        if type(t) is not int or t < 0:
            raise ValueError(f"bad shapes row {row!r}: context must be an integer >= 0 (prompt tokens)")
        if row.get("spec") is not None:
            _read_spec(row["spec"])
    return data


def _read_spec(fields: Any) -> SpecConfig:
    names = ("num_speculative_tokens", "top_k", "num_draft_tokens")
    if not isinstance(fields, dict) or not set(names) <= set(fields) or not set(fields) <= {*names, *LOOKUP_FIELDS}:
        raise ValueError(f"a profile shape needs exactly {names} (and optionally {LOOKUP_FIELDS}), got {fields!r}")
    bad = {k: v for k, v in fields.items() if type(v) is not int}
    if bad:
        raise ValueError(f"profile shape fields must be integers, got {bad}")
    return SpecConfig(**fields)


def policy_from_profile(data: dict, source: str, device: torch.device | str, path: str | None = None) -> ShapePolicy:
    """The ``ShapePolicy`` of a profile: its ``shapes`` table, and the rule for the batches the
    table lacks, within the rows the next smaller measured batch verified (``ShapePolicy.choose``;
    the batch-1 shape's ``num_draft_tokens`` is the budget). Rows with a ``context`` threshold form a
    sub-policy per threshold (``ShapePolicy.contexts``), scaled by their own batch-1 greedy row."""
    spec = _read_spec(data["spec"])
    tables: dict[int, dict] = {0: {(1, "greedy"): spec}}
    for row in data.get("shapes") or []:
        table = tables.setdefault(row.get("context", 0), {})
        table[row["batch_size"], row["sampling"]] = _read_spec(row["spec"]) if row.get("spec") else None
    kind = "cuda" if torch.device(device).type == "cuda" else "cpu"
    base = tables.pop(0)
    policy = ShapePolicy(source, spec.num_draft_tokens, kind, base, path=path)
    if (ladder := _b1_ladder(data, 0)) is not None:
        policy.ladders[1, "greedy"] = ladder
    for t, table in tables.items():  # long-context buckets: the rule there scales their own batch-1 shape
        b1 = table.get((1, "greedy"), spec)
        budget = b1.num_draft_tokens if b1 is not None else 1  # plain decoding won batch 1: plain above it too
        sub = policy.contexts[t] = ShapePolicy(source, budget, kind, table, path=path)
        if (ladder := _b1_ladder(data, t)) is not None:  # its shapes' rates are the long prompts' own (its row's)
            sub.ladders[1, "greedy"] = replace(ladder, min_rounds=LONG_MIN_ROUNDS)
    return policy


def _b1_greedy(row: dict, context: int) -> bool:
    """``row`` is the batch-1 greedy row of the prompts of at least ``context`` tokens (0: the short ones)."""
    return row["batch_size"] == 1 and row["sampling"] == "greedy" and row.get("context", 0) == context


def _b1_ladder(data: dict, context: int) -> ShapeLadder | None:
    """``shape_ladder`` of the profile's batch-1 greedy row for ``context`` (None: no row, or plain decoding won)."""
    row = next((r for r in data.get("shapes") or [] if _b1_greedy(r, context)), None)
    return shape_ladder(data, row) if row is not None and row.get("spec") else None


LADDER_MIN_RATE = 0.7  # a ladder keeps the shapes that measured >= this x the row's best (and beat plain)
SHAPE_KEY = re.compile(r"\((\d+),(\d+),(\d+)\)")  # "(D,K,N)", a measured shape in a row's decode_tokens_per_s


def shape_ladder(data: dict, row: dict) -> ShapeLadder | None:
    """The ``ShapeLadder`` of a profile's batch-1 greedy ``row`` (``runtime/adaptive.py``): the shapes
    measured there (its ``decode_tokens_per_s`` keys) at >= ``LADDER_MIN_RATE`` of the best and
    faster than plain decoding, each with the row's prompt-lookup settings, modelled with the
    profile's ``costs`` and ``acceptance`` and calibrated by the measured rates. None when the
    profile lacks them (older profiles), fewer than two shapes qualify, or the ladder would not keep
    the row's shape at λ = 1 (a row that chose a prompt-lookup variant whose bare shape measured
    slower than another: the ladder compares bare rates, so it would leave the tuned pick for a
    shape never measured with the lookup); a warning, and None, when they are malformed (the
    profile's shapes still apply, fixed)."""
    if not isinstance(data.get("costs"), dict) or not isinstance(data.get("acceptance"), dict):
        return None
    try:
        chosen = _read_spec(row["spec"])
        lookup = {k: getattr(chosen, k) for k in LOOKUP_FIELDS}
        rates = row.get("decode_tokens_per_s") or {}
        if not isinstance(rates, dict):
            raise ValueError(f"decode_tokens_per_s must be a table of shape -> tokens/s, got {type(rates).__name__}")
        measured = {k: float(v) for k, v in rates.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        shaped = {tuple(map(int, m.groups())): v for k, v in measured.items() if (m := SHAPE_KEY.fullmatch(str(k)))}
        if not shaped:
            return None
        floor = max(measured.get("plain", 0.0), LADDER_MIN_RATE * max(shaped.values()))
        shapes = [chosen]  # its rate: its shape's without the lookup branch, as every other rate here
        rate_of = [shaped.get((chosen.num_speculative_tokens, chosen.top_k, chosen.num_draft_tokens))]
        for (d, k, n), rate in shaped.items():
            if rate < floor:
                continue  # no hopeless shape (the model may misjudge it)
            try:
                shapes.append(SpecConfig(d, k, n, **lookup))
            except (ValueError, TypeError):
                continue  # a shape this version would not run
            rate_of.append(rate)
        c, a = data["costs"], data["acceptance"]
        ns = [int(n) for n in c["verify_n"]]
        if any(x >= y for x, y in zip(ns, ns[1:])):
            raise ValueError(f"costs.verify_n must increase strictly, got {ns}")
        costs = CostModel(
            ns,
            [float(x) for x in c["verify_s"]],
            {int(k): float(v) for k, v in c["draft_head_s"].items()},
            {int(k): float(v) for k, v in c["draft_step_s"].items()},
            (float(c["commit_s"][0]), float(c["commit_s"][1])),
            float(c["plain_s"]),
            float(c.get("overhead_s", 0.0)),
        )
        acc = AcceptanceProfile(
            [[float(x) for x in r] for r in a["p"]],
            [int(x) for x in a.get("samples") or []],
            [[float(x) for x in r] for r in a["score"]] if a.get("score") else None,
        )
        ladder = ShapeLadder.build(shapes, acc, costs, rate_of)
        if ladder is None or chosen not in ladder.shapes:
            return None
        if ladder.best[LAMBDAS.index(1.0)] != ladder.shapes.index(chosen):
            return None  # it would move a request accepted as predicted off the tuned shape (a lookup pick)
        return ladder
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, ArithmeticError) as e:
        _warn(
            f"the tuned profile's costs, acceptance or measured rates are malformed ({e!r}); "
            "requests keep its shapes fixed"
        )
        return None


def shape_policy(target: Any, drafter: Any, backend: str, compiled: bool = False) -> ShapePolicy:
    """How ``SpeculativeRuntime(spec=None)`` picks shapes for this pair on this device: the first
    usable profile (module docstring; ``compiled``: compiled-rounds profiles first), else the rule
    of ``runtime/spec_policy.py``."""
    if drafter is None:
        return ShapePolicy.heuristic(target.device)
    try:
        paths = candidate_profiles(target, drafter, backend, compiled)
    except Exception as e:  # noqa: BLE001 - a lookup must never break model loading
        _warn(f"tuned tree profile lookup failed ({e}); using the default shapes")
        return ShapePolicy.heuristic(target.device)
    own_names = own_profile_names(target, drafter, backend, compiled)
    for path in paths:
        shipped = path.parent == SHIPPED_DIR
        try:
            data = read_profile(path)
            made_by = (data.get("versions") or {}).get("tritonspec")
            if not shipped and _minor(made_by) != _minor(store.package_version()):
                _warn(
                    f"ignoring the tuned tree profile {path}: tuned with tritonspec {made_by}, this is "
                    f"{store.package_version()}; re-run `tritonspec autotune tree`"
                )
                continue
            source = "shipped profile" if shipped else "profile"
            if path.name.endswith(",rounds=compiled.json"):
                source += " (compiled rounds)"
            if path.name not in own_names:
                source += f" ({data.get('device_name')})"  # another vector ISA of this architecture
            return policy_from_profile(data, source, target.device, str(path))
        except (OSError, ValueError, TypeError) as e:
            _warn(f"ignoring the tuned tree profile {path} ({e}); using the default shapes")
    return ShapePolicy.heuristic(target.device)


def _minor(version: str | None) -> tuple[str, ...]:
    return tuple((version or "").split(".")[:2])


def _warn(msg: str) -> None:
    warnings.warn(msg, store.TunedConfigWarning, stacklevel=4)
