"""Regenerate ``perf/REPORT.md`` (tables) and PNG plots from a pytest-benchmark JSON of
``perf/bench_e2e.py``.

    python perf/report.py perf/e2e.json [--out perf/REPORT.md]

Speedup = tokens/s ÷ ``ours-plain`` tokens/s of the same prompt set, temperature and batch,
measured in the same run (same process, same prompts).
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections import defaultdict
from pathlib import Path

from tritonspec.demo import PROMPT_SETS

ORDER = ["ours-plain", "hf-greedy", "hf-prompt-lookup", "hf-assisted", "ours-eagle3", "ours-eagle3.1"]


def load(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    rows = [b["extra_info"] for b in data["benchmarks"] if b.get("extra_info", {}).get("system")]
    if not rows:
        raise SystemExit(f"{path} has no end-to-end results (run perf/bench_e2e.py with --benchmark-json)")
    return rows


def render(rows: list[dict], source: str) -> tuple[str, dict]:
    groups: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        groups[(r["prompt_set"], r["temperature"], r["batch"])][r["system"]] = r
    env = rows[0]
    out = [
        "# tritonspec end-to-end performance report",
        "",
        f"Generated {datetime.date.today().isoformat()} from `{source}` by `perf/report.py`. "
        f"Pair: {env.get('pair')}; device: {env.get('device')}; torch {env.get('torch')}, transformers "
        f"{env.get('transformers')}, triton {env.get('triton')}, tritonspec {env.get('tritonspec')}, "
        f"{env.get('threads')} threads; {env.get('prompts')} prompts per set x {env.get('max_new_tokens')} new tokens "
        "(EOS ignored, so every system generates the same number of tokens).",
        "",
        "Speedup is against `ours-plain` (plain decoding through our runtime) for the same set, temperature "
        "and batch, measured in the same run. τ = 1 + accepted / drafts; acceptance per depth = rounds that "
        "accepted depth k / rounds. `n/a`: transformers runs prompt lookup and assisted generation at batch 1 only.",
        "",
    ]
    speedups: dict[str, dict[str, float]] = defaultdict(dict)
    for pset, temp, batch in sorted(
        groups, key=lambda k: (k[2], k[1], PROMPT_SETS.index(k[0]) if k[0] in PROMPT_SETS else 9)
    ):
        g = groups[(pset, temp, batch)]
        base = g.get("ours-plain", {}).get("tokens_per_second")
        out += [
            f"## {pset}, temperature {temp:g}, batch {batch}",
            "",
            "| system | tokens/s | speedup | τ | acceptance per depth |",
            "|---|---:|---:|---:|---|",
        ]
        for s in ORDER:
            r = g.get(s)
            if r is None:
                out.append(f"| {s} | n/a | | | |")
                continue
            sp = r["tokens_per_second"] / base if base else None
            if sp is not None and temp == 0 and batch == 1:
                speedups[s][pset] = sp
            tau = f"{r['tau']:.2f}" if r.get("tau") else ""
            acc = " ".join(f"{a:.2f}" for a in r.get("accepted_per_position") or [])
            out.append(f"| {s} | {r['tokens_per_second']:.1f} | {f'{sp:.2f}x' if sp else ''} | {tau} | {acc} |")
        out.append("")
    return "\n".join(out), speedups


def plots(rows: list[dict], speedups: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    sets = list(PROMPT_SETS)
    systems = [s for s in ORDER if s in speedups and s != "ours-plain"]
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    width = 0.8 / max(len(systems), 1)
    for i, s in enumerate(systems):
        ax.bar([j + i * width for j in range(len(sets))], [speedups[s].get(p, 0) for p in sets], width, label=s)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sets))], sets)
    ax.set(ylabel="speedup over ours-plain", title="greedy, batch 1")
    ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(out_dir / "speedup.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2), sharey=True)
    for ax, pset in zip(axes, sets):
        for s in ("ours-eagle3", "ours-eagle3.1"):
            r = next(
                (
                    r
                    for r in rows
                    if r["system"] == s and r["prompt_set"] == pset and r["temperature"] == 0 and r["batch"] == 1
                ),
                None,
            )
            if r:
                acc = r["accepted_per_position"]
                ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{s} (τ {r['tau']:.2f})")
        ax.set(title=pset, xlabel="draft depth", ylim=(0, 1))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[0].set_ylabel("acceptance (greedy, batch 1)")
    fig.tight_layout()
    files.append(out_dir / "acceptance.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", type=Path)
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("REPORT.md"))
    p.add_argument("--note", default="", help="conditions of the run (machine load, spec shape), quoted in the report")
    a = p.parse_args(argv)
    rows = load(a.json)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    text, speedups = render(rows, a.json.name)
    if a.note:
        text = text.replace("\n\n", f"\n\n**Conditions.** {a.note}\n\n", 1)
    files = plots(rows, speedups, a.out.parent)
    text += "\n" + "\n".join(f"![{f.stem}]({f.name})" for f in files) + "\n"
    a.out.write_text(text)
    print(f"wrote {a.out} and {', '.join(f.name for f in files)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
