"""Soak: 2,000 mixed calls on one runtime (issue 14), recording memory and throughput at the start
and at the end, with outputs spot-checked against a fresh runtime.

    python -m pytest perf/bench_soak.py -m slow --benchmark-json soak.json   # ~20 min on a busy 2-core CPU
    python -m pytest perf/bench_soak.py -m slow --soak-calls 200 --benchmark-disable   # a quick look

The calls are drawn from a seeded generator: batch 1-4, greedy and sampled (seeded), speculative
and plain, ``generate`` and ``stream`` (one in four), and streams broken off after a few pieces
(closed, or just dropped). Every 40th call is replayed on a fresh runtime of the same pair (built
beside the soaked one, unused until then), which must give the same tokens. ``extra_info``: RSS
(MiB) and tokens/s over the first and the last 100 calls, their change, and the spot-check count.
Not a timed test: it asserts the spot checks and a loose bound on RSS growth, never a speed.
Marked ``slow`` (CI deselects it: ``-m "not slow"``).
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from tritonspec import demo
from tritonspec.runtime.engine import SpeculativeRuntime

from conftest import DEVICE

WINDOW = 100  # calls averaged for the start and end figures
SPOT_EVERY = 40
MAX_SEQ_LEN = 512
MAX_PROMPT = 256  # tokens; longer prompts are left out (a soak is about many calls, not long ones)
RSS_GROWTH_LIMIT_MB = 256  # a leak of ~0.1 MiB per call would pass unnoticed below this; a real one does not


def _rss_mb() -> float:
    """Resident set size of this process now (Linux ``/proc``; else the peak from ``resource``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # pragma: no cover - not Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def _pair(tmp_path_factory) -> tuple[str, str, list[str], str]:
    if demo.available():
        target, drafter = demo.demo_pair("eagle3.1")
        prompts = [r["prompt"] for name in demo.PROMPT_SETS for r in demo.prompt_set(name)]  # standard, long, perturbed
        return str(target), str(drafter), prompts, "demo"
    from tritonspec.runtime.tiny import tiny_random_pair

    target, drafter = tiny_random_pair(tmp_path_factory.mktemp("soak"))
    code = "def f(x):\n    return x + 1\n\n"
    return str(target), str(drafter), [code, code * 2, "import os\n", "class A:\n"], "tiny-random"


def _runtime(target: str, drafter: str) -> SpeculativeRuntime:
    return SpeculativeRuntime.from_pretrained(target, drafter, device=DEVICE, max_batch_size=4, max_seq_len=MAX_SEQ_LEN)


def _calls(n: int, prompts: list[str], seed: int = 14):
    """``(kind, prompts, kwargs, pieces)`` for ``n`` mixed calls; ``pieces``: where a stream breaks off."""
    rng = random.Random(seed)
    for _ in range(n):
        kind = "stream" if rng.random() < 0.25 else "generate"
        batch = 1 if kind == "stream" else rng.randint(1, 4)
        sampled = rng.random() < 0.5
        kw = dict(
            max_new_tokens=rng.randint(4, 32),
            temperature=rng.choice([0.7, 1.0]) if sampled else 0.0,
            top_p=rng.choice([1.0, 0.9]),
            seed=rng.randrange(2**31),
            speculative=rng.random() < 0.8,
        )
        pieces = rng.randint(1, 4) if kind == "stream" and rng.random() < 0.7 else None  # None: to the end
        yield kind, rng.sample(prompts, batch), kw, pieces


def _run(rt: SpeculativeRuntime, kind: str, prompts: list[str], kw: dict, pieces: int | None, close: bool):
    """One call; returns its token ids per prompt."""
    if kind == "generate":
        return rt.generate(prompts, **kw).token_ids
    ids: list[int] = []
    it = rt.stream(prompts[0], **kw)
    for k, piece in enumerate(it):
        ids += piece.token_ids
        if pieces is not None and k + 1 == pieces:
            break
    if close:
        it.close()
    return [ids]  # else dropped: the generator is closed when its last reference goes


@pytest.mark.slow
def test_soak(benchmark, request, tmp_path_factory):
    n = request.config.getoption("--soak-calls")
    if DEVICE == "cpu":
        torch.set_num_threads(1)  # several intra-op threads spin against each other on a busy small CPU
    target, drafter, prompts, pair = _pair(tmp_path_factory)
    rt = _runtime(target, drafter)
    # the reference: built now, so it reads the same tuned profiles (a profile written while the soak
    # runs would change the shapes, and sampled tokens with them), and unused until the end
    fresh = _runtime(target, drafter)
    prompts = [p for p in prompts if len(rt.tokenizer(p)["input_ids"]) <= MAX_PROMPT]
    calls = list(_calls(n, prompts))
    log: list[tuple[float, int]] = []  # (seconds, new tokens) per call
    spots: list[tuple[int, list[list[int]]]] = []
    rss: dict[str, float] = {}

    def soak():
        for i, (kind, ps, kw, pieces) in enumerate(calls):
            if i == WINDOW:
                rss["start"] = _rss_mb()  # after the first window: caches, graphs and allocator warmed up
            t0 = time.perf_counter()
            ids = _run(rt, kind, ps, kw, pieces, close=i % 2 == 0)
            log.append((time.perf_counter() - t0, sum(len(x) for x in ids)))
            if i % SPOT_EVERY == 0:
                spots.append((i, ids))
        rss["end"] = _rss_mb()

    benchmark.pedantic(soak, rounds=1, iterations=1, warmup_rounds=0)
    rss.setdefault("start", rss["end"])

    bad = [i for i, ids in spots if _run(fresh, *calls[i], close=True) != ids]

    def tps(window):
        return sum(t for _, t in window) / max(sum(s for s, _ in window), 1e-9)

    w = min(WINDOW, max(len(log) // 2, 1))
    start, end = tps(log[:w]), tps(log[-w:])
    benchmark.extra_info.update(
        pair=pair,
        device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        calls=len(calls),
        streams=sum(c[0] == "stream" for c in calls),
        streams_broken_off=sum(c[0] == "stream" and c[3] is not None for c in calls),
        new_tokens=sum(t for _, t in log),
        rss_mb_start=round(rss["start"], 1),
        rss_mb_end=round(rss["end"], 1),
        rss_growth_mb=round(rss["end"] - rss["start"], 1),
        tokens_per_s_start=round(start, 1),
        tokens_per_s_end=round(end, 1),
        tokens_per_s_ratio_end_start=round(end / max(start, 1e-9), 3),
        spot_checks=len(spots),
        spot_check_mismatches=bad,
        timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    assert not bad, f"calls {bad} differ from a fresh runtime"
    assert rss["end"] - rss["start"] < RSS_GROWTH_LIMIT_MB, benchmark.extra_info
