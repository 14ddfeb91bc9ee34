"""Loss and accuracy curves of the shipped SmolLM2 drafters (from their ``training_args.json``).

python -m tritonspec.recipes.smollm2.plot --out recipes/smollm2/curves.png
python -m tritonspec.recipes.smollm2.plot --before old/ --out curves.png   # a warm-started run after its source run
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ...drafters import ROOT

VARIANTS = ("eagle3", "eagle3.1")
WINDOW = 50  # steps in the running means (one batch's loss swings +-30 %)


def running_mean(xs: list[float], window: int = WINDOW) -> list[float]:
    """Mean of the last ``window`` values at each index (fewer at the start)."""
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x - (xs[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def history(drafters: Path, variant: str, before: Path | None = None) -> tuple[list[dict], int]:
    """The per-step history of ``drafters/smollm2-<variant>``, after that of the drafter it was
    warm-started from when ``before`` holds one (steps renumbered), and the step it resumed at (0: none;
    a variant absent from ``before`` was not warm-started there and plots its own run alone)."""
    hist = json.loads((drafters / f"smollm2-{variant}" / "training_args.json").read_text())["history"]
    if before is None or not (before / f"smollm2-{variant}").exists():
        return hist, 0
    old = json.loads((before / f"smollm2-{variant}" / "training_args.json").read_text())["history"]
    return old + [dict(h, step=h["step"] + len(old)) for h in hist], len(old)


def main(argv: list[str] | None = None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = argparse.ArgumentParser(prog="python -m tritonspec.recipes.smollm2.plot", description=__doc__)
    p.add_argument("--drafters", default=str(ROOT), help="folder holding smollm2-eagle3 and smollm2-eagle3.1")
    p.add_argument("--out", default="curves.png")
    p.add_argument(
        "--before",
        default=None,
        help="folder holding the drafters the shipped ones were warm-started from (--warm-start): their "
        "curves come first, and a line marks the warm start (a variant absent there plots its own run alone)",
    )
    args = p.parse_args(argv)
    before = Path(args.before) if args.before else None
    if before is not None and not any((before / f"smollm2-{v}").exists() for v in VARIANTS):
        p.error(
            f"--before {args.before}: holds neither smollm2-eagle3 nor smollm2-eagle3.1 (give the --warm-start DIR)"
        )
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.6))
    for v in VARIANTS:
        hist, warm_at = history(Path(args.drafters), v, before)
        if warm_at:
            for ax in (ax_loss, ax_acc):
                ax.axvline(warm_at, color="grey", lw=0.6, ls="--")
        steps = [h["step"] for h in hist]
        loss = ax_loss.plot(steps, [h["loss"] for h in hist], lw=0.5, alpha=0.25)[0]
        ax_loss.plot(steps, running_mean([h["loss"] for h in hist]), color=loss.get_color(), label=v, lw=1.2)
        for j, style in ((0, "-"), (len(hist[0]["acc"]) - 1, ":")):
            acc = running_mean([h["acc"][j] for h in hist])
            ax_acc.plot(steps, acc, style, label=f"{v} depth {j + 1}", lw=1.2)
    ax_loss.set(xlabel="step", ylabel="TTT loss", title=f"training loss (faint: each batch; line: {WINDOW}-step mean)")
    acc_title = f"training accuracy, {WINDOW}-step mean (first and last depth)"
    ax_acc.set(xlabel="step", ylabel="top-1 accuracy", title=acc_title)
    ax_loss.legend()
    ax_acc.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
