"""Measure the demo pair: acceptance length τ per drafter and tokens/s plain vs speculative, per prompt set.

Every prompt runs alone (batch 1, greedy) through one ``SpeculativeRuntime`` per drafter; plain
decoding runs through the same runtime (``speculative=False``), back to back with the two
speculative runs of the same prompt, and the speculative output is checked token for token.
Also measures the cost of one drafter step against one target step (single-token decode at
contexts of 128, 512 and 1,500 tokens), the ratio the demo target was sized for (<= 1/8).

    python -m tritonspec.training.evaluate --n 20 --max-new-tokens 64 --out demo/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..runtime.config import SpecConfig
from ..runtime.engine import SpeculativeRuntime
from ..runtime.metadata import AttentionMetadata


@dataclass
class SetResult:
    """Aggregates over one prompt set for one drafter (rounds-weighted τ, tokens over total time)."""

    name: str
    variant: str
    prompts: int
    tau: float
    spec_tps: float
    plain_tps: float
    identical: bool
    accepted_per_position: list[int]
    rounds: int

    @property
    def speedup(self) -> float:
        return self.spec_tps / self.plain_tps if self.plain_tps else 0.0


def evaluate_set(
    rts: dict[str, SpeculativeRuntime], name: str, prompts: list[str], max_new_tokens: int
) -> list[SetResult]:
    """Run every prompt plain and with each drafter, back to back per prompt.

    Interleaving keeps the comparison fair on shared cores, where the load drifts over minutes.
    Plain decoding runs through the first runtime (the same target code and caches).
    """
    first = next(iter(rts.values()))
    plain_tokens, plain_time = 0, 0.0
    acc = {
        v: {
            "drafts": 0,
            "accepted": 0,
            "tokens": 0,
            "time": 0.0,
            "same": True,
            "per_pos": [0] * rt.spec.num_speculative_tokens,
        }
        for v, rt in rts.items()
    }
    for p in prompts:
        base = first.generate(p, max_new_tokens=max_new_tokens, speculative=False)
        plain_tokens += base.stats.num_new_tokens
        plain_time += base.stats.wall_time_s
        for v, rt in rts.items():
            s = rt.generate(p, max_new_tokens=max_new_tokens, speculative=True)
            a = acc[v]
            a["same"] &= s.token_ids == base.token_ids
            a["drafts"] += s.stats.num_drafts
            a["accepted"] += s.stats.num_accepted_tokens
            a["tokens"] += s.stats.num_new_tokens
            a["time"] += s.stats.wall_time_s
            a["per_pos"] = [x + y for x, y in zip(a["per_pos"], s.stats.accepted_per_position)]
    return [
        SetResult(
            name,
            v,
            len(prompts),
            1 + a["accepted"] / max(a["drafts"], 1),
            a["tokens"] / a["time"],
            plain_tokens / plain_time,
            a["same"],
            a["per_pos"],
            a["drafts"],
        )
        for v, a in acc.items()
    ]


@torch.inference_mode()
def step_cost_ratio(rt: SpeculativeRuntime, context: int = 512, reps: int = 30) -> tuple[float, float]:
    """Seconds per single-token target step and per single-token drafter step at ``context``.

    The target was sized so that the drafter step costs at most 1/8 of the target step.
    """
    t, d, ops = rt.target, rt.drafter, rt.ops
    B = 1
    tok = torch.zeros(B, 1, dtype=torch.int64)
    pos = torch.full((B, 1), context, dtype=torch.int64)
    meta = AttentionMetadata(pos, pos, torch.tensor([context]), torch.ones(B, 1, 1, dtype=torch.bool), context + 1)
    hid = torch.zeros(B, 1, d.config.hidden_size)

    def target_step():
        h, _ = t.forward(ops, tok, meta, capture_aux=True)
        t.logits(h).argmax(-1)

    def drafter_step():
        hn, _ = d.step(ops, hid, tok, meta, rt.decoder.draft_cache)
        d.logits(hn).argmax(-1)

    return _time(target_step, reps), _time(drafter_step, reps)


def _time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(3):  # best of three batches of reps (robust to other processes on the cores)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def run(n: int, max_new_tokens: int, spec: SpecConfig, out: Path | None, append: bool = False) -> list[SetResult]:
    from ..demo import PROMPT_SETS, demo_pair, prompt_set

    results: list[SetResult] = []
    rts = {}
    for variant in ("eagle3", "eagle3.1"):
        tdir, ddir = demo_pair(variant)
        rts[variant] = SpeculativeRuntime.from_pretrained(
            tdir, ddir, spec=spec, max_batch_size=1, max_seq_len=2048, backend="torch"
        )
    ratio = {ctx: step_cost_ratio(rts["eagle3"], ctx) for ctx in (128, 512, 1500)}
    for ctx, (ts_, ds_) in ratio.items():
        print(
            f"step cost at context {ctx}: target {ts_ * 1e3:.2f} ms, drafter {ds_ * 1e3:.2f} ms "
            f"(ratio 1/{ts_ / ds_:.1f})",
            flush=True,
        )
    for name in PROMPT_SETS:
        prompts = [r["prompt"] for r in prompt_set(name)[:n]]
        for r in evaluate_set(rts, name, prompts, max_new_tokens):
            results.append(r)
            print(
                f"{name:9s} {r.variant:8s} tau={r.tau:.2f} spec={r.spec_tps:.1f} tok/s plain={r.plain_tps:.1f} "
                f"tok/s speedup={r.speedup:.2f}x identical={r.identical} "
                f"accepted_per_position={r.accepted_per_position}",
                flush=True,
            )
    if out is not None:
        text = render(results, n, max_new_tokens, spec, ratio)
        if append and out.exists():
            section = text.split("\n", 2)[2].replace("Measured", f"## {spec}\n\nMeasured", 1)
            text = out.read_text() + "\n" + section
        out.write_text(text)
    return results


DEFAULT_TREE = SpecConfig()  # the command's default --num-speculative-tokens / --draft-top-k / --num-draft-tokens


def _shape_flags(spec: SpecConfig) -> str:
    """The command-line flags that select ``spec`` when it is not the default tree ("" when it is)."""

    def tree(s: SpecConfig) -> tuple[int, int, int]:
        return s.num_speculative_tokens, s.top_k, s.num_draft_tokens

    if tree(spec) == tree(DEFAULT_TREE):
        return ""
    return (
        f" --num-speculative-tokens {spec.num_speculative_tokens} --draft-top-k {spec.top_k} "
        f"--num-draft-tokens {spec.num_draft_tokens}"
    )


def render(results: list[SetResult], n: int, max_new_tokens: int, spec: SpecConfig, ratio) -> str:
    """The Markdown report (``demo/RESULTS.md``)."""
    by = {(r.name, r.variant): r for r in results}
    lines = [
        "# Demo pair: measured acceptance length and CPU throughput",
        "",
        f"Measured {datetime.date.today().isoformat()} with `python -m tritonspec.training.evaluate --n {n} "
        f"--max-new-tokens {max_new_tokens}{_shape_flags(spec)}` on {platform.processor() or platform.machine()} "
        f"(torch threads: {torch.get_num_threads()}, {os.cpu_count()} CPU cores; "
        f"torch {torch.__version__}, backend torch, float32).",
        f"Greedy, batch 1, first {n} prompts of each set, `{spec}`. τ = 1 + accepted / rounds (tokens per target "
        "verify forward). tokens/s = new tokens / wall time summed over the prompts; plain decoding runs through "
        "the same runtime, and for each prompt plain, EAGLE-3 and EAGLE-3.1 run back to back (a load that drifts "
        "over minutes hits the three alike). `identical` = speculative output equals plain output token for token.",
        "",
    ]
    if ratio is not None:
        lines += [
            "Cost of one drafter step (step + draft logits) against one target step (forward + logits), "
            "single-token decode, best of 3 x 30 calls:",
            "",
            "| context | target step | drafter step | ratio |",
            "|---|---|---|---|",
        ]
        lines += [f"| {ctx} | {t * 1e3:.2f} ms | {d * 1e3:.2f} ms | 1/{t / d:.1f} |" for ctx, (t, d) in ratio.items()]
        lines += [""]
    lines += [
        "| prompt set | τ EAGLE-3 | τ EAGLE-3.1 | plain tok/s | EAGLE-3 tok/s | EAGLE-3.1 tok/s | "
        "speedup 3 / 3.1 | identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r.name for r in results):
        a, b = by[(name, "eagle3")], by[(name, "eagle3.1")]
        lines.append(
            f"| {name} | {a.tau:.2f} | {b.tau:.2f} | {a.plain_tps:.1f} | {a.spec_tps:.1f} | {b.spec_tps:.1f} "
            f"| {a.speedup:.2f}x / {b.speedup:.2f}x | {a.identical and b.identical} |"
        )
    lines += ["", "Accepted draft tokens per depth (rounds in which depth i was accepted):", ""]
    for r in results:
        lines.append(f"- {r.name} / {r.variant}: {r.accepted_per_position} over {r.rounds} rounds")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tritonspec.training.evaluate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--n", type=int, default=20, help="prompts per set")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=DEFAULT_TREE.num_speculative_tokens)
    p.add_argument("--draft-top-k", type=int, default=DEFAULT_TREE.top_k)
    p.add_argument("--num-draft-tokens", type=int, default=DEFAULT_TREE.num_draft_tokens)
    p.add_argument("--out", default=None, help="write the Markdown report here")
    p.add_argument("--append", action="store_true", help="append a section to --out instead of overwriting it")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the cores are shared)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    spec = SpecConfig(a.num_speculative_tokens, a.draft_top_k, a.num_draft_tokens)
    run(a.n, a.max_new_tokens, spec, Path(a.out) if a.out else None, a.append)
    return 0


if __name__ == "__main__":
    sys.exit(main())
