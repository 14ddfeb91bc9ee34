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
        "curves come first, and a line marks the warm start",
    )
    args = p.parse_args(argv)
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.6))
    for v in VARIANTS:
        hist = json.loads((Path(args.drafters) / f"smollm2-{v}" / "training_args.json").read_text())["history"]
        if args.before:
            old = json.loads((Path(args.before) / f"smollm2-{v}" / "training_args.json").read_text())["history"]
            hist = old + [dict(h, step=h["step"] + len(old)) for h in hist]
            for ax in (ax_loss, ax_acc):
                ax.axvline(len(old), color="grey", lw=0.6, ls="--")
        steps = [h["step"] for h in hist]
        ax_loss.plot(steps, [h["loss"] for h in hist], label=v, lw=1)
        for j, style in ((0, "-"), (len(hist[0]["acc"]) - 1, ":")):
            ax_acc.plot(steps, [h["acc"][j] for h in hist], style, label=f"{v} depth {j + 1}", lw=1)
    ax_loss.set(xlabel="step", ylabel="TTT loss", title="training loss")
    ax_acc.set(xlabel="step", ylabel="top-1 accuracy", title="training accuracy (first and last depth)")
    ax_loss.legend()
    ax_acc.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
