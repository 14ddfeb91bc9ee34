"""Kernel-config search: a candidate list per kernel, each timed through the real launcher.

For every op and model shape the tuner launches the op's public launcher once per candidate
(``store.forced`` makes the launcher use it), skips candidates that raise ``OutOfResources``
or whose output differs from the default config's (bit for bit for the discrete kernels,
allclose for the float ones), times the rest with ``triton.testing.do_bench`` (median; on a
CPU under ``TRITON_INTERPRET=1``, wall-clock medians — a machinery check, not a tuning) and
writes the winner to the per-device store.

What each op is keyed on (the bucket) and timed at:

=============== ============== ====================================================================
op              bucket         timed at
=============== ============== ====================================================================
rms_norm        hidden size    tree-token rows, fused residual (a row count is never a key: the
                               config sets the reduction tree, so it must not vary with the batch)
aux_gather      row width      plain gather (fc_norm off, rows n_aux*H wide) of max_depth+1 rows;
                               the fused gather uses rms_norm's entry (it must equal rms_norm bit
                               for bit)
tree_attention  head_dim       one row, tree-token queries over a ``context``-token prefix; the
                               prefix split size is tuned here too, per head_dim only
verify_greedy   tree tokens N  one row (discrete: any config gives the same bits)
kv_compact      Hkv * head_dim all layers, one row, a max_depth+1 path (discrete)
=============== ============== ====================================================================
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..kernels import store
from ..kernels.aux_gather import aux_gather, gather_config
from ..kernels.kv_compact import compact_config, kv_compact
from ..kernels.rms_norm import rms_norm
from ..kernels.tree_attention import attention_config, tree_attention
from ..kernels.utils import next_pow2, rms_config
from ..kernels.verify import verify_config, verify_greedy

OPS = ("rms_norm", "aux_gather", "tree_attention", "verify_greedy", "kv_compact")
BUCKETS = {
    "rms_norm": "hidden_size",
    "aux_gather": "row_width",
    "tree_attention": "head_dim",
    "verify_greedy": "num_draft_tokens",
    "kv_compact": "kv_width",
}


@dataclass(frozen=True)
class KernelShape:
    """The model dimensions the kernels see, and the sizes configs are timed at (never keys)."""

    name: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    n_aux: int = 3
    tree_tokens: int = 48  # rows / queries per verify round (SpecConfig().num_draft_tokens)
    context: int = 4096  # committed prefix the tree attends to
    max_depth: int = 6

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim


LLAMA3_8B = KernelShape("llama-3-8b", hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, num_layers=32)


def shape_from_model_dir(path: str | Path) -> KernelShape:
    """A ``KernelShape`` from a Hugging Face model directory's ``config.json``."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    return KernelShape(
        name=Path(path).name,
        hidden_size=cfg["hidden_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        num_layers=cfg["num_hidden_layers"],
    )


# ------------------------------------------------------------------ candidates, one function per kernel
def _warps_upto(block: int) -> list[dict]:
    return [{"num_warps": w} for w in (1, 2, 4, 8, 16) if w == 1 or 32 * w <= block]


def rms_norm_configs(hidden: int) -> list[dict]:
    """num_warps over the row (BLOCK_H is next_pow2(H): the whole row sits in registers)."""
    return _warps_upto(max(next_pow2(hidden), 16))


def aux_gather_configs(width: int) -> list[dict]:
    """num_warps of the plain gather (one program per row chunk)."""
    return rms_norm_configs(width)


def tree_attention_configs(head_dim: int) -> list[dict]:
    """Query/key tiles, warps, pipeline stages and the fixed prefix split size."""
    block_ns = (32, 64) if head_dim <= 128 else (16, 32)
    return [
        dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st, split_kv=sp)
        for m, n, w, st, sp in itertools.product((32, 64, 128), block_ns, (4, 8), (2, 3), (1024, 2048, 4096))
    ]


def verify_greedy_configs(n: int) -> list[dict]:
    """num_warps of the one-program-per-row tree walk."""
    return [{"num_warps": w} for w in (1, 2, 4)]


def kv_compact_configs(kv_width: int, path_len: int) -> list[dict]:
    """Column chunk per program and num_warps (chunk x path rows bounded to keep registers sane)."""
    bm = max(next_pow2(path_len), 2)
    chunks = [c for c in (128, 256, 512, 1024, 2048, 4096) if c <= max(next_pow2(kv_width), 128) and c * bm <= 16384]
    return [{"BLOCK_C": c, "num_warps": w} for c in chunks for w in (2, 4, 8)]


# ------------------------------------------------------------------ problems: inputs + a call of the launcher
@dataclass
class Problem:
    op: str
    bucket: int
    run: Callable[[], object]  # launches the op once through its public launcher, returns the output(s)
    candidates: list[dict]
    exact: bool  # discrete kernel: candidates must match bit for bit


def problems(shape: KernelShape, dtype: torch.dtype, device: torch.device, ops: Iterable[str] = OPS) -> list[Problem]:
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*s):
        return torch.randn(*s, generator=g).to(device=device, dtype=dtype)

    H, Q, D = shape.hidden_size, shape.tree_tokens, shape.head_dim
    out: list[Problem] = []
    for op in ops:
        if op == "rms_norm":
            x, r, w = randn(Q, H), randn(Q, H), randn(H)
            out.append(Problem(op, H, lambda x=x, r=r, w=w: rms_norm(x, w, 1e-5, r), rms_norm_configs(H), False))
        elif op == "aux_gather":  # as the drafter calls it with fc_norm off: one n_aux*H-wide chunk per row
            W = shape.n_aux * H
            aux = randn(Q, W)
            idx = torch.arange(shape.max_depth + 1, device=device)
            out.append(Problem(op, W, lambda a=aux, i=idx: aux_gather(a, i, None, 1e-5), aux_gather_configs(W), True))
        elif op == "tree_attention":
            S = shape.context + Q + 1
            q = randn(1, Q, shape.num_heads, D)
            kc, vc = randn(1, S, shape.num_kv_heads, D), randn(1, S, shape.num_kv_heads, D)
            pl = torch.tensor([shape.context], device=device)
            mask = torch.ones(Q, Q, dtype=torch.bool, device=device).tril()[None]
            out.append(
                Problem(
                    op,
                    D,
                    lambda q=q, kc=kc, vc=vc, pl=pl, m=mask: tree_attention(q, kc, vc, pl, m, D**-0.5),
                    tree_attention_configs(D),
                    False,
                )
            )
        elif op == "verify_greedy":
            tok = torch.randint(0, 8, (1, Q), generator=g).to(device)
            par = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, Q)]], device=device)
            arg = torch.randint(0, 8, (1, Q), generator=g).to(device)
            out.append(
                Problem(
                    op,
                    Q,
                    lambda t=tok, p=par, a=arg: verify_greedy(t, p, a, shape.max_depth),
                    verify_greedy_configs(Q),
                    True,
                )
            )
        elif op == "kv_compact":
            ctx = min(shape.context, 512)
            shp = (shape.num_layers, 1, ctx + Q + 1, shape.num_kv_heads, D)
            kc, vc = randn(*shp), randn(*shp)
            start = torch.tensor([ctx], device=device)
            md = shape.max_depth
            # path nodes md+1 .. 2md: sources and destinations never overlap, so repeated calls are idempotent
            nodes = torch.tensor([[0] + [md + i for i in range(1, md + 1)]], device=device)

            def run(kc=kc, vc=vc, start=start, nodes=nodes, ctx=ctx):
                kv_compact(kc, vc, start, nodes)
                return kc[:, :, ctx : ctx + shape.max_depth + 1]

            out.append(Problem(op, shape.kv_width, run, kv_compact_configs(shape.kv_width, shape.max_depth + 1), True))
        else:
            raise ValueError(f"unknown op {op!r}: use one of {OPS}")
    return out


# ------------------------------------------------------------------ timing and the search
def _out_of_resources() -> tuple[type, ...]:
    try:
        from triton.runtime.errors import OutOfResources
    except ImportError:  # pragma: no cover - older Triton
        from triton.runtime.autotuner import OutOfResources
    return (OutOfResources,)


def bench_us(fn: Callable[[], object], device: torch.device) -> float:
    """Median time of ``fn()`` in microseconds: ``triton.testing.do_bench`` on a GPU, wall clock on a CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return 1e3 * do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * sorted(times)[len(times) // 2]


@dataclass
class TuneResult:
    op: str
    bucket: str
    value: int
    best: dict
    best_us: float
    default: dict
    default_us: float
    tried: int
    skipped: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        return self.default_us / self.best_us if self.best_us > 0 else 1.0


def _same(a, b, exact: bool) -> bool:
    if isinstance(a, (tuple, list)):
        return all(_same(x, y, exact) for x, y in zip(a, b))
    if exact:
        return torch.equal(a, b)
    return torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2, equal_nan=True)


def tune_problem(
    p: Problem,
    device: torch.device,
    progress: Callable | None = None,
    bench: Callable[[Callable, torch.device], float] = bench_us,
) -> TuneResult:
    """Time every candidate of ``p``; the default (heuristic) config is timed too, as the baseline."""
    oor = _out_of_resources()
    with store.forced(p.op, {}):  # an empty forced config = the launcher's heuristic, whatever is stored
        ref = p.run()
        ref = tuple(t.clone() for t in ref) if isinstance(ref, tuple) else ref.clone()
        default_us = bench(p.run, device)
    best, best_us, skipped = None, float("inf"), []
    for cfg in p.candidates:
        with store.forced(p.op, cfg):
            try:
                got = p.run()
                if not _same(got, ref, p.exact):
                    skipped.append(f"{cfg}: output differs from the default config")
                    continue
                us = bench(p.run, device)
            except oor as e:
                skipped.append(f"{cfg}: {type(e).__name__}")
                continue
        if us < best_us:
            best, best_us = cfg, us
        if progress is not None:
            progress()
    if best is None:
        raise RuntimeError(f"{p.op}: no candidate config ran ({'; '.join(skipped)})")
    default = dict(_default_config(p.op, p.bucket))
    if default_us <= best_us:  # never store a config slower than the heuristic
        best, best_us = default, default_us
    return TuneResult(p.op, BUCKETS[p.op], p.bucket, best, best_us, default, default_us, len(p.candidates), skipped)


def _default_config(op: str, value: int) -> dict:
    """The launcher's heuristic for ``value`` (what an untuned install runs), for the report."""
    if op == "rms_norm":
        return {"num_warps": rms_config(value)[1]}
    if op == "aux_gather":
        return {"num_warps": gather_config(value)[1]}
    if op == "tree_attention":
        return attention_config(value, torch.float32)
    if op == "verify_greedy":
        return {"num_warps": verify_config(value)}
    if op == "kv_compact":
        c, w = compact_config(value, 8)
        return {"BLOCK_C": c, "num_warps": w}
    return {}


def tune_kernels(
    shapes: list[KernelShape],
    dtype: torch.dtype,
    device: str | torch.device = "cuda",
    *,
    ops: Iterable[str] = OPS,
    out_dir: str | Path | None = None,
    dry_run: bool = False,
    candidates: dict[str, list[dict]] | None = None,
    show_progress: bool | None = None,
    bench: Callable[[Callable, torch.device], float] = bench_us,
) -> tuple[list[TuneResult], list[Path]]:
    """Tune ``ops`` for every shape; write the winners (merged per op file) unless ``dry_run``.

    ``candidates`` replaces an op's candidate list (tests use two-config lists). The progress bar
    (tqdm) shows only on a TTY unless ``show_progress`` says otherwise. Returns the results and
    the files written. Run it before any CUDA-graph capture: it launches many kernels.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    probs = [p for s in shapes for p in problems(s, dtype, device, ops)]
    seen, unique = set(), []
    for p in probs:  # two shapes with the same hidden size share the rms_norm bucket: tune it once
        if (p.op, p.bucket) not in seen:
            seen.add((p.op, p.bucket))
            unique.append(p)
    for p in unique:
        if candidates and p.op in candidates:
            p.candidates = list(candidates[p.op])
    total = sum(len(p.candidates) for p in unique)
    show = sys.stderr.isatty() if show_progress is None else show_progress
    bar = _bar(total, show)
    store.clear_cache()
    results = []
    try:
        for p in unique:
            if bar is not None:
                bar.set_description(f"{p.op}[{p.bucket}]")
            results.append(tune_problem(p, device, bar.update if bar is not None else None, bench))
    finally:
        if bar is not None:
            bar.close()
    written: list[Path] = []
    if not dry_run:
        out = Path(out_dir) if out_dir is not None else store.user_dir()
        for op in dict.fromkeys(r.op for r in results):
            rs = [r for r in results if r.op == op]
            table = store.make_table(
                op,
                BUCKETS[op],
                {r.value: r.best for r in rs},
                dtype="int64" if op == "verify_greedy" else store.dtype_name(dtype),
                device=device,
                timings_us={r.value: {"default": round(r.default_us, 2), "best": round(r.best_us, 2)} for r in rs},
            )
            written.append(store.write_table(table, out))
    return results, written


def _bar(total: int, show: bool):
    if not show:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, unit="cfg", file=sys.stderr)


def format_results(results: list[TuneResult]) -> str:
    """The winners as a plain-text table."""
    rows = [("op", "bucket", "default", "default us", "tuned", "tuned us", "speedup", "tried/skipped")]
    for r in results:
        rows.append(
            (
                r.op,
                f"{r.bucket}={r.value}",
                _cfg(r.default),
                f"{r.default_us:.1f}",
                _cfg(r.best),
                f"{r.best_us:.1f}",
                f"{r.speedup:.2f}x",
                f"{r.tried}/{len(r.skipped)}",
            )
        )
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def _cfg(c: dict) -> str:
    short = {"num_warps": "w", "num_stages": "s", "split_kv": "split", "BLOCK_M": "M", "BLOCK_N": "N", "BLOCK_C": "C"}
    return " ".join(f"{short.get(k, k)}={v}" for k, v in c.items()) or "-"
