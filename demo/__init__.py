"""The bundled demo pair: a small Llama code model trained on the CPython standard library, with an
EAGLE-3 and an EAGLE-3.1 drafter trained on the same data and budget.

Built by ``python -m tritonspec.recipes.demo --out demo/`` (``manifest.json`` records the
corpus file hashes, seeds and hyper-parameters); evaluation prompts live in ``prompts/*.jsonl``.

>>> import tritonspec as ts
>>> target_dir, drafter_dir = ts.demo_pair("eagle3.1")    # doctest: +SKIP
>>> rt = ts.SpeculativeRuntime.from_pretrained(target_dir, drafter_dir)   # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent
VARIANTS = {"eagle3": "drafter-eagle3", "eagle3.1": "drafter-eagle3.1"}
PROMPT_SETS = ("standard", "long", "perturbed")
# prompts the benchmarks take from the front of each set (perf/bench_e2e.py, bench_deterministic.py,
# bench_defaults.py: this many per set by default)
BENCH_ROWS = 8
# tuning slices (``tuning_prompts``): rows of the standard and long sets from source files that none of
# the first BENCH_ROWS rows of any set come from, one per file, so `autotune tree --target demo` does not
# tune on what the speedup reports (bench_e2e, bench_deterministic, bench_defaults) measure;
# perf/bench_continuous.py (static vs continuous batching, standard[:32], long[:16]) and bench_soak do
# include them
TUNING_SETS = {"standard": "tune.jsonl", "long": "tune_long.jsonl"}


def available() -> bool:
    """True when the demo weights are installed (they are built by the demo recipe)."""
    return (ROOT / "target" / "config.json").exists() and all(
        (ROOT / d / "config.json").exists() for d in VARIANTS.values()
    )


def demo_pair(variant: str = "eagle3.1") -> tuple[Path, Path]:
    """``(target_dir, drafter_dir)`` of the bundled demo models.

    Parameters
    ----------
    variant : ``"eagle3"`` or ``"eagle3.1"`` (the drafter with fc_norm and post-norm feedback).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: use one of {sorted(VARIANTS)}")
    target, drafter = ROOT / "target", ROOT / VARIANTS[variant]
    for d in (target, drafter):
        if not (d / "config.json").exists():
            raise FileNotFoundError(
                f"the demo weights are missing ({d}); build them with "
                "`python -m tritonspec.recipes.demo --out <package>/demo`"
            )
    return target, drafter


def _rows(path: Path, missing: str) -> list[dict]:
    import json

    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: {missing}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def prompt_set(name: str) -> list[dict]:
    """Rows ``{"id", "source", "prompt"}`` of a bundled evaluation set (standard, long, perturbed)."""
    if name not in PROMPT_SETS:
        raise ValueError(f"prompt set {name!r}: use one of {PROMPT_SETS}")
    return _rows(ROOT / "prompts" / f"{name}.jsonl", "build the demo with the recipe")


def tuning_prompts(name: str = "standard") -> list[dict]:
    """Rows ``{"id", "source", "prompt"}`` for tuning on the demo pair: ``"standard"`` (16 rows) or
    ``"long"`` (8 rows), drawn from the set of that name after its first ``BENCH_ROWS`` rows and
    from files that no benchmark row of any set comes from (one row per file). ``autotune tree
    --target demo`` uses them by default (``--long-prompts demo`` for the long rows).

    >>> [r["source"] for r in tuning_prompts("long")][:2]   # doctest: +SKIP
    ['encodings/mac_iceland.py', 'fileinput.py']
    """
    if name not in TUNING_SETS:
        raise ValueError(f"tuning set {name!r}: use one of {sorted(TUNING_SETS)}")
    return _rows(ROOT / "prompts" / TUNING_SETS[name], "reinstall tritonspec (it ships with the demo prompts)")


__all__ = ["demo_pair", "prompt_set", "tuning_prompts", "available", "VARIANTS", "PROMPT_SETS", "BENCH_ROWS"]
