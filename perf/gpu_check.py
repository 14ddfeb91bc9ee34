"""The GPU check of the Triton kernels: one prepared script for a session that has a GPU.

    python perf/gpu_check.py             # everything, about 8-9 minutes on an H200 (hard cap --budget-s)
    python perf/gpu_check.py --dry-run   # print the plan and the commands, run nothing

Steps, in order, each a subprocess whose output is streamed here and saved under ``$OUT`` (when
set, else ``perf/gpu_check_out/``):

1. install the project offline: ``pip install --no-deps --no-build-isolation -e .``
2. the GPU tests: CUDA-graph replay against eager (``tests/test_cuda_graphs.py``), then the kernel
   tests compiled on the GPU (no interpreter when CUDA is present):
   ``pytest tests/test_cuda_graphs.py tests/test_kernels_*.py tests/test_backend_triton.py
   tests/test_deterministic_gpu.py`` (deterministic mode on the GPU: speculative equals plain bit for
   bit, alone equals batched, the audit, and the inverse: cuBLAS rounds a row differently by M)
   (``-n 8`` when pytest-xdist is there: compilation is CPU-bound)
3. graphs against eager end to end (``perf/bench_graphs.py``): the demo pair and a random
   Llama-3-8B-shaped bf16 target with a random drafter, plain and speculative, batch 1 and 4,
   runners eager / graphs / graphs-det (deterministic mode with graphs; its cost is noted under
   the table): tokens/s, τ, ms per round, the eager draft/verify/commit split, kernel launches per round;
   JSON to ``graphs.json``; its table is printed last with the *projected* 8B speedup (the 8B
   pair's graph round costs combined with the demo pair's measured τ)
4. the kernel benchmarks at Llama-3-8B shapes (H 4096, 32/8 heads, head_dim 128, 60 tree tokens,
   2K-32K context, vocabulary 128256; set in ``perf/bench_kernels_*.py`` when CUDA is present),
   one step per file (``--bench-file-timeout-s`` each, so a slow file loses only its own rows),
   pytest-benchmark JSON parts merged into ``bench.json``
5. a device-to-device copy baseline (1 GiB ``copy_``, bytes read + written / time, CUDA events)
6. the tables, printed last and written to ``summary.md``: op, shape, us/call and GB/s launched from
   Python and replayed from a CUDA graph, % of the copy
   GB/s; the figures ``perf/RESULTS.md`` asks for.

Each step gets a timeout carved from ``--budget-s`` (default 570 s, under the 10-minute limit of a
device command with room to spare; on the H200, 2026-12-04: tests 96 s, 24 graph rows 154 s, the
kernel files about 150 s; the tests step has 240 s since deterministic mode's attention kernel and its tests
were added, run right after the graph tests); a step that runs out is killed and the script goes on, so
the table always comes out (the tests run with ``-v``, so a killed step still names what failed).
``--tests NODE...``, ``--graphs-k EXPR``, ``--skip-install``, ``--skip-tests`` and ``--bench FILE...`` select
parts; without CUDA the same code runs the reference rows at CPU shapes and a host-memory copy
(how ``tests/test_perf_gpu_check.py`` exercises it).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INFO_KEYS_HIDDEN = {
    "device",
    "us_per_call",
    "us_per_call_graph",
    "gbps_graph",
    "graph_error",
    "bytes",
    "gbps",
    "timestamp",
    "provider",
}


def out_dir() -> Path:
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "perf" / "gpu_check_out"


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def plan(args, out: Path) -> list[tuple[str, list[str], float]]:
    """``[(step, argv, timeout_s)]`` for the subprocess steps."""
    py = sys.executable
    steps = []
    if not args.skip_install:
        steps.append(
            ("install", [py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", "."], 120.0)
        )
    if not args.skip_tests:
        # deterministic mode's right after the graphs: its kernels (det_attention) are the newest, never run on a
        # GPU before, and a step killed at its timeout loses the files at its end
        first = ["test_cuda_graphs.py", "test_deterministic_gpu.py", "test_kernels_det_attention.py"]
        kernels = [os.path.basename(t) for t in sorted(glob.glob(str(ROOT / "tests" / "test_kernels_*.py")))]
        tests = args.tests or [
            f"tests/{n}" for n in first + [k for k in kernels if k not in first] + ["test_backend_triton.py"]
        ] + ["tests/test_perf_gpu_check.py::test_graph_time_times_a_capturable_call_and_reports_one_that_is_not"]
        cmd = [
            py,
            "-m",
            "pytest",
            *tests,
            "-v",  # a line per test as it ends: the names survive a step killed at its timeout
            "-p",
            "no:cacheprovider",
            "--durations=10",
            "--tb=short",
            "-rfEs",
        ]
        if args.workers and has("xdist"):
            cmd += ["-n", str(args.workers)]
        steps.append(("tests", cmd, args.test_timeout_s))
    if not args.skip_graphs:
        steps.append(
            (
                "graphs",
                [
                    py,
                    "-m",
                    "pytest",
                    "perf/bench_graphs.py",
                    *(["-k", args.graphs_k] if args.graphs_k else []),
                    "--benchmark-only",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    f"--benchmark-json={out / 'graphs.json'}",
                ],
                args.graphs_timeout_s,
            )
        )
    benches = args.bench or sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(str(ROOT / "perf" / "bench_kernels_*.py"))
    )
    for bench in benches:  # one step per file: a file that runs out of time loses its own rows only
        part = out / f"bench-{Path(bench).stem}.json"
        steps.append(
            (
                f"bench:{Path(bench).stem.removeprefix('bench_kernels_')}",
                [
                    py,
                    "-m",
                    "pytest",
                    bench,
                    "--benchmark-only",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    f"--benchmark-json={part}",
                ],
                args.bench_file_timeout_s,
            )
        )
    return steps


def run_step(name: str, argv: list[str], timeout_s: float, out: Path) -> dict:
    """Run ``argv`` in the repo root, tee its output to the console and ``<name>.log``; kill the
    whole process group at ``timeout_s``."""
    print(f"\n=== {name}: {shlex.join(argv)}  (timeout {timeout_s:.0f} s)", flush=True)
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # the bench:<op> steps share bench.log (the files that come back from a device run are few)
    with open(out / f"{name.split(':')[0]}.log", "a" if ":" in name else "w") as log:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )

        def pump():
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            sys.stdout.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = "timeout"
            proc.wait()
        reader.join(timeout=10)
    wall = time.perf_counter() - t0
    print(f"=== {name}: rc={rc} in {wall:.1f} s", flush=True)
    return dict(step=name, rc=rc, wall_s=round(wall, 1))


def copy_baseline(mib: int = 1024, iters: int = 20) -> dict:
    """Device-to-device ``dst.copy_(src)`` GB/s (bytes read + written); host memory without CUDA."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        mib, iters = min(mib, 64), min(iters, 5)
    dev = "cuda" if cuda else "cpu"
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        sec = start.elapsed_time(end) / 1e3 / iters
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        sec = (time.perf_counter() - t0) / iters
    return dict(
        device=torch.cuda.get_device_name() if cuda else "cpu", mib=mib, gbps=round(2 * src.numel() / sec / 1e9, 1)
    )


def read_json(path: Path) -> dict:
    """A pytest-benchmark JSON, or {} when the file is missing, empty or cut short (a killed step)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def merge_bench_parts(out: Path) -> dict:
    """Merge the per-file ``bench-*.json`` into ``bench.json`` (and remove the parts)."""
    merged: dict = {"benchmarks": []}
    for part in sorted(out.glob("bench-*.json")):
        merged["benchmarks"] += read_json(part).get("benchmarks", [])
        part.unlink()
    if merged["benchmarks"]:
        (out / "bench.json").write_text(json.dumps(merged, indent=1))
    return merged


def table_rows(bench: dict, copy_gbps: float | None) -> list[dict]:
    """One row per benchmark of a pytest-benchmark JSON (``extra_info`` as ``perf/conftest.py`` fills it)."""
    rows = []
    for b in bench.get("benchmarks", []):
        info = b.get("extra_info", {})
        if "us_per_call" not in info:
            continue
        shape = " ".join(f"{k}={v}" for k, v in info.items() if k not in INFO_KEYS_HIDDEN)
        gbps, gbps_graph = info.get("gbps"), info.get("gbps_graph")
        pct = lambda g: 100 * g / copy_gbps if g is not None and copy_gbps else None  # noqa: E731
        rows.append(
            dict(
                op=b["name"].removeprefix("test_"),
                shape=shape,
                us=info["us_per_call"],
                us_graph=info.get("us_per_call_graph"),
                gbps=gbps,
                pct_copy=pct(gbps),
                gbps_graph=gbps_graph,
                pct_copy_graph=pct(gbps_graph),
                graph_error=info.get("graph_error"),
            )
        )
    return rows


def graph_rows(graphs: dict) -> list[dict]:
    """One row per ``perf/bench_graphs.py`` benchmark (its ``extra_info``)."""
    keys = (
        "pair",
        "mode",
        "runner",
        "batch",
        "tokens_s",
        "tau",
        "round_ms",
        "draft_ms",
        "verify_ms",
        "commit_ms",
        "launches",
        "aten_ops",
    )
    return [
        {k: b.get("extra_info", {}).get(k) for k in keys}
        for b in graphs.get("benchmarks", [])
        if "round_ms" in b.get("extra_info", {})
    ]


def format_graph_table(rows: list[dict]) -> str:
    """Graphs vs eager, and the projected 8B speedup (8B graph round costs x the demo pair's τ)."""
    if not rows:
        return "graphs vs eager: no rows (perf/bench_graphs.py did not run)"

    def f(v, nd=2):
        return "-" if v is None else f"{v:.{nd}f}" if isinstance(v, float) else str(v)

    head = (
        "| pair | mode | runner | batch | tok/s | τ | ms/round | eager draft | eager verify | eager commit | "
        "launches/round (eager) | aten ops/round |\n|" + " --- |" * 4 + " ---: |" * 8
    )
    lines = [
        f"| {r['pair']} | {r['mode']} | {r['runner']} | {r['batch']} | {f(r['tokens_s'], 1)} | {f(r['tau'])} | "
        f"{f(r['round_ms'])} | {f(r['draft_ms'])} | {f(r['verify_ms'])} | {f(r['commit_ms'])} | {f(r['launches'])} | "
        f"{f(r['aten_ops'])} |"
        for r in rows
    ]
    at = {(r["pair"], r["mode"], r["runner"], r["batch"]): r for r in rows}
    notes = []
    for (pair, mode, runner, batch), r in sorted(at.items()):
        e = at.get((pair, mode, "eager", batch))
        if runner == "graphs" and e and e["tokens_s"]:
            notes.append(f"- {pair} {mode} batch {batch}: graphs {r['tokens_s'] / e['tokens_s']:.2f}x eager tokens/s")
        d = at.get((pair, mode, "graphs", batch))
        if runner == "graphs-det" and d and d["tokens_s"] and r["tokens_s"]:
            notes.append(
                f"- {pair} {mode} batch {batch}: deterministic {r['tokens_s'] / d['tokens_s']:.2f}x default tokens/s "
                "(both with graphs)"
            )
    for batch in sorted({r["batch"] for r in rows}):
        demo = at.get(("demo", "speculative", "graphs", batch)) or at.get(("demo", "speculative", "eager", batch))
        p8 = at.get(("llama3-8b-random", "plain", "graphs", batch))
        s8 = at.get(("llama3-8b-random", "speculative", "graphs", batch))
        if demo and p8 and s8 and s8["round_ms"]:
            proj = demo["tau"] * p8["round_ms"] / s8["round_ms"]
            notes.append(
                f"- PROJECTED llama3-8b speedup, batch {batch}: τ {demo['tau']:.2f} (demo pair, same tree) x "
                f"plain round {p8['round_ms']:.2f} ms / speculative round {s8['round_ms']:.2f} ms = {proj:.2f}x "
                "(projected, not measured: the 8B drafter is random)"
            )
    return "\n".join([head, *lines, "", *notes])


def format_table(rows: list[dict], copy: dict | None) -> str:
    """us/call launched from Python (what a caller without graphs pays) and, on CUDA, replayed from a
    CUDA graph (the kernels alone); GB/s and % of the copy baseline both ways. Rows whose calls could
    not be captured say why under the table."""
    head = (
        "| op | shape | us/call | us/call in a graph | GB/s | GB/s in a graph | % of copy GB/s | % in a graph |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    )

    def fmt(v):  # 3 significant digits below 100, whole numbers above
        return "-" if v is None else f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"

    lines = [
        f"| {r['op']} | {r['shape']} | {fmt(r['us'])} | {fmt(r.get('us_graph'))} | {fmt(r['gbps'])} | "
        f"{fmt(r.get('gbps_graph'))} | {fmt(r['pct_copy'])} | {fmt(r.get('pct_copy_graph'))} |"
        for r in rows
    ]
    errors = [f"- {r['op']}: not captured ({r['graph_error']})" for r in rows if r.get("graph_error")]
    note = (
        (f"\ncopy baseline: {copy['gbps']} GB/s ({copy['mib']} MiB dst.copy_(src) on {copy['device']}, read + write)")
        if copy
        else "\ncopy baseline: not measured"
    )
    return "\n".join([head, *lines, *errors]) + "\n" + note


def environment() -> dict:
    import torch

    env = dict(python=sys.version.split()[0], torch=torch.__version__, cuda=torch.cuda.is_available())
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if env["cuda"]:
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sm=f"{p.major}{p.minor}", sms=p.multi_processor_count)
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dry-run", action="store_true", help="print the plan and commands, run nothing")
    ap.add_argument("--skip-install", action="store_true")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-graphs", action="store_true", help="skip perf/bench_graphs.py")
    ap.add_argument("--graphs-timeout-s", type=float, default=240.0)  # H200, 2026-12-04: 24 rows took 154 s
    ap.add_argument("--bench", nargs="*", default=None, help="benchmark files (default: perf/bench_kernels_*.py)")
    ap.add_argument("--bench-file-timeout-s", type=float, default=90.0, help="cap per benchmark file")
    ap.add_argument("--tests", nargs="*", default=None, help="test files or node ids (default: the GPU set)")
    ap.add_argument("--graphs-k", default=None, help="pytest -k expression for perf/bench_graphs.py rows")
    ap.add_argument("--budget-s", type=float, default=570.0, help="hard cap for the whole script (default 570)")
    ap.add_argument("--test-timeout-s", type=float, default=240.0)  # H200, 2026-12-04: 133 tests, 96 s (+det_attention)
    ap.add_argument("--workers", type=int, default=8, help="pytest-xdist workers for the tests (0: none)")
    args = ap.parse_args(argv)
    out = out_dir()
    steps = plan(args, out)
    reserve = 30.0  # the copy baseline and the table

    if args.dry_run:
        print(f"gpu_check plan (budget {args.budget_s:.0f} s, output to {out}):")
        for i, (name, cmd, timeout_s) in enumerate(steps, 1):
            t = "the rest of the budget" if timeout_s == float("inf") else f"<= {timeout_s:.0f} s"
            print(f"{i}. {name} ({t}): {shlex.join(cmd)}")
        print(f"{len(steps) + 1}. copy baseline: 1 GiB device-to-device dst.copy_(src), CUDA events, 20 copies")
        print(
            f"{len(steps) + 2}. tables: op, shape, us/call and GB/s launched and in a CUDA graph, % of copy GB/s; "
            "graphs vs eager with the projected "
            f"8B speedup -> {out / 'summary.md'}"
        )
        return 0

    deadline = time.perf_counter() + args.budget_s
    out.mkdir(parents=True, exist_ok=True)
    earlier = ["bench.log", "bench.json", "graphs.json", "graphs.log", "tests.log", "install.log", "summary.md"]
    for name in [*earlier, "summary.json", *(p.name for p in out.glob("bench-*.json"))]:  # an earlier run's
        (out / name).unlink(missing_ok=True)
    env = environment()
    print("environment:", json.dumps(env), flush=True)
    results = []
    for name, cmd, timeout_s in steps:
        left = deadline - time.perf_counter() - reserve
        if left < 5:
            results.append(dict(step=name, rc="skipped: budget spent"))
            continue
        results.append(run_step(name, cmd, min(timeout_s, left), out))

    copy = None
    try:
        copy = copy_baseline()
    except Exception as e:  # noqa: BLE001 - reported, the table still prints
        print(f"copy baseline failed: {type(e).__name__}: {e}")
    bench = merge_bench_parts(out)
    rows = table_rows(bench, copy["gbps"] if copy else None)
    graphs_path = out / "graphs.json"
    grows = graph_rows(read_json(graphs_path))
    table = format_table(rows, copy) + "\n\n" + format_graph_table(grows)
    date = time.strftime("%Y-%m-%d")
    steps_md = "\n".join(
        f"- {r['step']}: rc={r['rc']}" + (f", {r['wall_s']} s" if "wall_s" in r else "") for r in results
    )
    (out / "summary.md").write_text(
        f"# gpu_check {date}\n\nenvironment: `{json.dumps(env)}`\n\n{steps_md}\n\n{table}\n"
    )
    (out / "summary.json").write_text(
        json.dumps(dict(date=date, environment=env, steps=results, copy=copy, rows=rows, graphs=grows), indent=1)
    )
    print(
        f"\n=== summary ({date}, {env.get('gpu', 'no GPU')}; steps: "
        + ", ".join(f"{r['step']}={r['rc']}" for r in results)
        + ")"
    )
    print(table)
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
