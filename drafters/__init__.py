"""Drafters trained here for real pretrained targets, shipped in float16.

``smollm2-eagle3`` and ``smollm2-eagle3.1``: EAGLE-3 / EAGLE-3.1 drafters for SmolLM2-135M-Instruct
(``--target smollm2``), built by ``python -m tritonspec.recipes.smollm2`` (its README records the
data, steps, wall time and loss curves).

>>> from tritonspec.drafters import shipped_drafter
>>> shipped_drafter("smollm2", "eagle3.1").name    # doctest: +SKIP
'smollm2-eagle3.1'
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent
VARIANTS = ("eagle3", "eagle3.1")


def shipped_drafter(model: str, variant: str = "eagle3.1") -> Path | None:
    """The shipped drafter directory for ``model`` (e.g. ``"smollm2"``), or None when there is none."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: use one of {VARIANTS}")
    d = ROOT / f"{model}-{variant}"
    return d if (d / "config.json").exists() else None


__all__ = ["shipped_drafter", "VARIANTS"]
