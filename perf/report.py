"""Regenerate ``perf/REPORT.md`` (tables) and PNG plots from a pytest-benchmark JSON of
``perf/bench_e2e.py``; rows of ``perf/bench_smollm2.py`` (the SmolLM2 pair) get a section of their own.

    python perf/report.py perf/e2e.json [--out perf/REPORT.md]
    python perf/report.py perf/smollm2.json [--out perf/SMOLLM2.md]   # SmolLM2 rows only

Speedup = tokens/s ÷ ``ours-plain`` tokens/s of the same prompt set, temperature and batch,
measured in the same run (same process, same prompts); with several passes (``--e2e-passes``) the
median of the per-pass ratios, their range beside it. Without ``--out`` the report goes to
``perf/REPORT.md``, or to ``perf/SMOLLM2.md`` when the JSON holds SmolLM2 rows only; the SmolLM2
plots are ``smollm2-speedup.png`` and ``smollm2-acceptance.png`` next to it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from collections import defaultdict
from pathlib import Path

from tritonspec.demo import PROMPT_SETS

ORDER = ["ours-plain", "hf-greedy", "hf-prompt-lookup", "hf-assisted", "ours-eagle3", "ours-eagle3.1"]
SMOLLM2_SETS = ("humaneval", "chat", "long")  # perf/conftest.py


def load(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    rows = []
    for b in data["benchmarks"]:
        info = b.get("extra_info", {})
        if info.get("system"):  # one system per benchmark (perf/bench_smollm2.py, older e2e files)
            rows.append(info)
        rows += info.get("systems", [])  # one interleaved group per benchmark (perf/bench_e2e.py)
    if not rows:
        raise SystemExit(
            f"{path} has no end-to-end results (run perf/bench_e2e.py or perf/bench_smollm2.py with --benchmark-json)"
        )
    return rows


def compiled_note(rows: list[dict]) -> str:
    """How our runtimes ran: compiled rounds (``--e2e-compile``) or eager, and the compile time kept
    out of the timings."""
    ours = [r for r in rows if r["system"].startswith("ours-")]
    if not any(r.get("compiled") for r in ours):
        return "Our runtimes ran eager rounds."
    total = sum(r.get("compile_s", 0.0) for r in ours)
    return (
        "Our runtimes ran compiled rounds (`compile=True`, plain decoding's round too); an untimed pass "
        f"per configuration compiled every key the timed pass met ({total:.0f} s in all, generation included)."
    )


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
        "(EOS ignored, so every system generates the same number of tokens). " + compiled_note(rows),
        "",
        "Speedup is against `ours-plain` (plain decoding through our runtime) for the same set, temperature "
        "and batch, measured in the same run. τ = 1 + accepted / drafts; acceptance per depth = rounds that "
        "accepted depth k / rounds. `n/a`: transformers runs prompt lookup and assisted generation at batch 1 only."
        + passes_note(rows),
        "",
    ]
    tables, speedups = speed_tables(groups, PROMPT_SETS, lambda p, t, b, g: f"## {p}, temperature {t:g}, batch {b}")
    out += tables
    return "\n".join(out), speedups


def speed_tables(groups: dict, sets, heading, identity: bool = False) -> tuple[list[str], dict]:
    """One Markdown table per (set, temperature, batch) group, batch then temperature then set order:
    tokens/s, speedup over ours-plain of the group, τ, acceptance per depth, and with ``identity``
    an ``= plain`` column on greedy tables. Returns the lines and the greedy batch-1 speedups
    ``{system: {set: speedup}}`` the plots use."""
    speedups: dict[str, dict[str, float]] = defaultdict(dict)
    out: list[str] = []
    for pset, temp, batch in sorted(groups, key=lambda k: (k[2], k[1], sets.index(k[0]) if k[0] in sets else 9)):
        g = groups[(pset, temp, batch)]
        base = g.get("ours-plain", {}).get("tokens_per_second")
        ident = identity and temp == 0
        out += [
            heading(pset, temp, batch, g),
            "",
            "| system | tokens/s | speedup | τ | acceptance per depth |" + (" = plain |" if ident else ""),
            "|---|---:|---:|---:|---|" + ("---|" if ident else ""),
        ]
        for s in ORDER:
            r = g.get(s)
            if r is None:
                out.append(f"| {s} | n/a | | | |" + (" |" if ident else ""))
                continue
            sp = r["tokens_per_second"] / base if base else None
            spread = ""
            per_pass = pass_speedups(r, g.get("ours-plain"))
            if per_pass:  # several passes: the median of the per-pass ratios, their range after it
                sp = statistics.median(per_pass)
                spread = f" ({min(per_pass):.2f}-{max(per_pass):.2f})" if s != "ours-plain" else ""
            if sp is not None and temp == 0 and batch == 1:
                speedups[s][pset] = sp
            tau = f"{r['tau']:.2f}" if r.get("tau") else ""
            acc = " ".join(f"{a:.2f}" for a in r.get("accepted_per_position") or [])
            row = f"| {s} | {r['tokens_per_second']:.1f} | {f'{sp:.2f}x{spread}' if sp else ''} | {tau} | {acc} |"
            out.append(row + (f" {_identical(r)} |" if ident else ""))
        out.append("")
    return out, speedups


def pass_speedups(r: dict, plain: dict | None) -> list[float]:
    """Per-pass speedups of row ``r`` over ``plain`` (its group's ours-plain) when both ran several passes
    (``Bench.run_interleaved(passes=...)``): plain's wall time over the system's, pass by pass (both generate
    the same tokens every pass); [] otherwise."""
    a, b = (r.get("pass_wall_s") or []), ((plain or {}).get("pass_wall_s") or [])
    if len(a) < 2 or len(a) != len(b) or not all(x > 0 for x in a):
        return []
    return [p / x for p, x in zip(b, a)]


def passes_note(rows: list[dict]) -> str:
    """How many passes the run made, and what the speedup column then holds."""
    n = max((len(r.get("pass_wall_s") or []) for r in rows), default=0)
    if n < 2:
        return ""
    same = all(r.get("same_tokens_every_pass") is not False for r in rows)
    return (
        f" Every group ran {n} interleaved passes: tokens/s is the median pass's, the speedup the median of the "
        "per-pass ratios with their range in brackets (the run's own noise); "
        + ("every pass generated the same tokens." if same else "**some pass generated other tokens** (see the JSON).")
    )


def plots(
    rows: list[dict], speedups: dict, out_dir: Path, sets: tuple | list = PROMPT_SETS, prefix: str = ""
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    sets = list(sets)
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
    files.append(out_dir / f"{prefix}speedup.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, len(sets), figsize=(11, 3.2), sharey=True, squeeze=False)
    axes = axes[0]
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
    files.append(out_dir / f"{prefix}acceptance.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files


def render_smollm2(rows: list[dict], source: str, title: bool = False) -> tuple[str, dict]:
    """The SmolLM2 section: one table per set / temperature / batch, speedups against ours-plain of
    the same set, temperature and batch, the token-for-token checks of greedy rows, the round split."""
    groups: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        groups[(r["prompt_set"], r["temperature"], r["batch"])][r["system"]] = r
    env = rows[0]
    threads = sorted({r.get("threads") for r in rows}, key=str)
    tokens = sorted({r.get("max_new_tokens") for r in rows}, key=str)
    out = ["# tritonspec end-to-end performance report: SmolLM2", ""] if title else []
    made = f"Generated {datetime.date.today().isoformat()} from `{source}` by `perf/report.py`. " if title else ""
    out += [
        "## SmolLM2-135M-Instruct (a real pretrained target)",
        "",
        f"{made}Pair: {env.get('pair')}; device: {env.get('device')}; torch {env.get('torch')}, transformers "
        f"{env.get('transformers')}, triton {env.get('triton')}, tritonspec {env.get('tritonspec')}, "
        f"threads: {'/'.join(map(str, threads))}; {'/'.join(map(str, tokens))} new tokens per prompt "
        "(EOS ignored, so every system generates the same number of tokens); prompts per table in its heading.",
        "",
        "Sets: `humaneval` (the first HumanEval problems in key order, raw code prompts, no chat template), "
        "`chat` (`perf/prompts/smollm2_chat.jsonl`, chat template applied) and `long` "
        "(`perf/prompts/smollm2_long.jsonl`, chat prompts of 1,500-3,000 tokens). Speedup is against `ours-plain` "
        "for the same set, temperature and batch, measured in the same run. τ = 1 + accepted / drafts. "
        "`n/a`: transformers runs prompt lookup and assisted generation at batch 1 only, and hf-assisted needs a "
        "smaller model of the SmolLM2 tokenizer, which is not installed. `= plain`: the greedy output equals "
        "ours-plain's (and hf-greedy's) token for token on every prompt.",
        "",
    ]

    def heading(pset: str, temp: float, batch: int, g: dict) -> str:
        n = max(r.get("prompts", 0) for r in g.values())
        return f"### {pset}, temperature {temp:g}, batch {batch} ({n} prompt{'s' if n != 1 else ''})"

    tables, speedups = speed_tables(groups, SMOLLM2_SETS, heading, identity=True)
    out += tables
    split = [r for r in rows if r.get("round_ms") is not None and r["temperature"] == 0 and r["batch"] == 1]
    if split:
        out += [
            "### Decode-round cost, greedy, batch 1 (eager, the set's first prompt)",
            "",
            "Milliseconds per round, phase by phase (the device synchronised after each), and the round in units of "
            "one plain decoding step of our runtime on the same prompt; τ ÷ (round / plain step) is the decode "
            "speedup those two predict (prefill excluded).",
            "",
            "| system | set | draft ms | verify ms | commit ms | round ms | plain step ms | round / plain step "
            "| τ | τ ÷ round |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in sorted(split, key=lambda r: (ORDER.index(r["system"]), _set_index(r["prompt_set"]))):
            steps = r.get("round_in_plain_steps")
            tau = r.get("tau")
            out.append(
                f"| {r['system']} | {r['prompt_set']} | {r['round_draft_ms']:.2f} | {r['round_verify_ms']:.2f} | "
                f"{r['round_commit_ms']:.2f} | {r['round_ms']:.2f} | {r['plain_step_ms']:.2f} | "
                f"{f'{steps:.2f}' if steps else ''} | {f'{tau:.2f}' if tau else ''} | "
                f"{f'{tau / steps:.2f}x' if tau and steps else ''} |"
            )
        out.append("")
    return "\n".join(out), speedups


def _set_index(pset: str) -> int:
    return SMOLLM2_SETS.index(pset) if pset in SMOLLM2_SETS else len(SMOLLM2_SETS)


def _identical(r: dict) -> str:
    """The token-for-token check of a greedy row: yes, no (where it first differed) or blank (not checked)."""
    same = r.get("identical")
    if same is None:
        return ""
    if same:
        return "yes"
    diffs = r.get("first_difference") or {}
    where = "; ".join(f"vs {ref}: prompt {d.get('prompt')}, step {d.get('step')}" for ref, d in diffs.items())
    return f"**no** ({where})" if where else "**no**"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", type=Path)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the report (default perf/REPORT.md; perf/SMOLLM2.md for a JSON of SmolLM2 rows only)",
    )
    p.add_argument("--note", default="", help="conditions of the run (machine load, spec shape), quoted in the report")
    a = p.parse_args(argv)
    rows = load(a.json)
    smol = [r for r in rows if r.get("suite") == "smollm2"]
    rows = [r for r in rows if r.get("suite") != "smollm2"]
    out = a.out or Path(__file__).with_name("REPORT.md" if rows else "SMOLLM2.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    text, files = "", []
    if rows:
        text, speedups = render(rows, a.json.name)
        files = plots(rows, speedups, out.parent)
        text += "\n" + "\n".join(f"![{f.stem}]({f.name})" for f in files) + "\n"
    if smol:
        section, speedups = render_smollm2(smol, a.json.name, title=not rows)
        sfiles = plots(smol, speedups, out.parent, SMOLLM2_SETS, prefix="smollm2-")
        text += ("\n" if text else "") + section
        text += "\n" + "\n".join(f"![{f.stem}]({f.name})" for f in sfiles) + "\n"
        files += sfiles
    if a.note:
        text = text.replace("\n\n", f"\n\n**Conditions.** {a.note}\n\n", 1)
    out.write_text(text)
    print(f"wrote {out} and {', '.join(f.name for f in files)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
