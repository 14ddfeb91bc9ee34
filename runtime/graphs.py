"""CUDA-graph capture and replay of decode rounds, one graph per (batch bucket, shape, sampling) key.

The runtime's round (``SpeculativeRuntime._round``: draft -> verify -> commit) reads and writes
only static buffers and the KV caches, with fixed shapes and no host synchronisation, so it can be
recorded once and replayed. ``GraphRunner.run(key, fn, state)``:

    first use of a key   run ``fn`` eagerly (this is the round: it also warms up Triton's JIT and
                         cuBLAS on a side stream), then capture ``fn`` into a graph (capture
                         records kernels without running them)
    later uses           replay the graph
    capture fails        warn once, run that key eagerly from then on (never a crash)
    rows beyond the      ``run`` returns False and the caller runs the round eagerly; one
    largest bucket       warning per runner

The same ``fn`` is what eager execution calls, so the eager path (every CPU test) exercises the
code that is captured. ``backend="compile"`` (the CPU's counterpart, ``compile=True``) records the
round's aten ops the same way and compiles them with ``torch.compile`` (inductor's C++ backend,
``fullgraph=True``, static shapes, ``COMPILE_OPTIONS``): one compiled artefact per key (the
engine adds the round's attention bound to it, ``Decoder.kv_bucket``), so a round pays neither Python
nor per-op dispatch; compiling takes from seconds (tiny models) to minutes (a 30-layer target) per
key, so it suits long-running serving. ``backend="emulate"`` is a CPU stand-in for tests: ``torch.fx``'s
``make_fx`` records the aten ops the round runs and replays only those, so Python code in the
round does not run again on replay, as with a CUDA graph. Recording executes the ops, so the
emulator snapshots the state buffers first and restores them after (a CUDA capture executes
nothing); the caches are only written at slots past the committed lengths, which the next
round rewrites.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

# inductor options of compiled CPU rounds. cpp_wrapper: the artefact calls its kernels from C++,
# not one Python call per kernel (the demo target's compiled step 2.99 -> 2.02 ms, one thread;
# compiling takes longer: ~60 s a key for the demo pair on 2 cores)
COMPILE_OPTIONS = {"cpp_wrapper": True}
MAX_GRAPHS = 64  # distinct (bucket, tree shape, sampling) keys captured per runtime; beyond: eager


def default_sizes(max_batch_size: int) -> list[int]:
    """Batch buckets 1, 2, 4, ... below ``max_batch_size``, and ``max_batch_size`` itself."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch_size]


class GraphRunner:
    """Captured decode rounds per key; ``key[0]`` is the round's row count (a bucket).

    Parameters
    ----------
    sizes : the batch buckets (ascending, distinct, >= 1).
    backend : ``"cuda"`` (``torch.cuda.CUDAGraph``), ``"compile"`` (``make_fx`` + ``torch.compile``,
        CPU) or ``"emulate"`` (CPU ``make_fx`` replay, tests).
    """

    def __init__(self, sizes: Sequence[int], backend: str = "cuda", device: torch.device | None = None):
        if backend not in ("cuda", "compile", "emulate"):
            raise ValueError(f"graph backend {backend!r}: use 'cuda', 'compile' or 'emulate'")
        self.what = "torch.compile of the decode round" if backend == "compile" else "CUDA-graph capture"
        self.sizes = sorted(set(int(s) for s in sizes))
        self.backend = backend
        self.device = device
        self.graphs: dict[Any, Any] = {}
        self.failed: set = set()
        self.captures = 0  # graphs captured (for tests and reports)
        self.replays = 0
        self._warned: set[str] = set()
        self._side = None  # CUDA: one side stream for warm-ups and captures
        self._pool = None  # CUDA: one memory pool shared by every graph (replays never overlap, and a
        #                    round's outputs live in the runtime's static buffers, not in the pool)

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket holding ``rows`` rows, or None when ``rows`` exceeds every bucket."""
        return next((s for s in self.sizes if s >= rows), None)

    def reset(self) -> None:
        """Drop every graph (the buffers they point at were reallocated)."""
        self.graphs.clear()
        self.failed.clear()

    def run(self, key: Any, fn: Callable[[], None], state: Sequence[torch.Tensor]) -> bool:
        """Run one round through its graph (capturing it on first use). Returns False when this key
        runs eagerly instead (the caller then calls ``fn``'s eager form itself)."""
        if key[0] not in self.sizes:
            self._warn_once(
                "size",
                f"a round of {key[0]} rows exceeds the captured CUDA-graph batch sizes "
                f"{self.sizes}; such rounds run eagerly (raise cuda_graph_sizes to capture them)",
            )
            return False
        if key in self.failed:
            return False
        g = self.graphs.get(key)
        if g is not None:
            self._replay(g)
            self.replays += 1
            return True
        if len(self.graphs) >= MAX_GRAPHS:
            self._warn_once(
                "many",
                f"{MAX_GRAPHS} CUDA graphs are captured already (one per batch bucket, tree "
                "shape and sampling setting); further settings run eagerly",
            )
            return False
        self._warm_up(fn)  # the round itself, eagerly
        try:
            self.graphs[key] = self._capture(fn, state)
            self.captures += 1
        except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager
            self.failed.add(key)
            warnings.warn(
                f"{self.what} failed for batch bucket {key[0]} ({type(e).__name__}: {e}); running these rounds eagerly",
                stacklevel=4,
            )
        return True

    # ------------------------------------------------------------------ backends
    def _streams(self) -> tuple[Any, Any]:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
            self._pool = torch.cuda.graph_pool_handle()
        return torch.cuda.current_stream(self.device), self._side

    def _warm_up(self, fn: Callable[[], None]) -> None:
        if self.backend == "cuda":
            with torch.cuda.device(self.device):
                cur, side = self._streams()
                side.wait_stream(cur)
                with torch.cuda.stream(side):
                    fn()
                cur.wait_stream(side)
        else:
            fn()

    def _capture(self, fn: Callable[[], None], state: Sequence[torch.Tensor]) -> Any:
        if self.backend == "cuda":
            # capture_begin/_end by hand: ``torch.cuda.graph`` leaves its capture stream current when
            # ``capture_end`` raises, and the eager fallback must not run on a dead capture stream
            with torch.cuda.device(self.device):
                cur, side = self._streams()
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                err: BaseException | None = None
                with torch.cuda.stream(side):  # restores the current stream on any exit
                    g.capture_begin(pool=self._pool)
                    try:
                        fn()
                    except BaseException as e:  # noqa: BLE001 - reported below: the root cause, not capture_end's
                        err = e
                    try:
                        g.capture_end()
                    except BaseException as e:  # noqa: BLE001
                        err = err or e
                if err is not None:
                    torch.cuda.synchronize(self.device)
                    self._recover(side)
                    raise err
                cur.wait_stream(side)
            return g
        from torch.fx.experimental.proxy_tensor import make_fx

        saved = [t.clone() for t in state]
        try:
            gm = make_fx(fn, tracing_mode="real")()
            if self.backend != "compile":
                return gm
            compiled = torch.compile(gm, fullgraph=True, dynamic=False, options=dict(COMPILE_OPTIONS))
            for t, s in zip(state, saved):
                t.copy_(s)
            compiled()  # compiles now (the state is restored below), so no request pays it twice
            return compiled
        finally:
            for t, s in zip(state, saved):
                t.copy_(s)

    def _recover(self, side: Any) -> None:
        """Undo what a failed capture leaves behind. ``capture_end`` raised before it ran the CUDA
        generators' capture epilogue, so the next random op on this device would raise "Offset
        increment outside graph capture encountered unexpectedly"; and the failed graph's memory
        pool trips the allocator's use-count assert at the next capture that reuses it. So: a fresh
        pool, and one tiny capture that completes (its begin and end reset the default generator)."""
        self._pool = torch.cuda.graph_pool_handle()
        try:
            scratch = torch.zeros(1, device=self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                g.capture_begin(pool=torch.cuda.graph_pool_handle())
                scratch.add_(1)
                g.capture_end()
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - reported; the eager fallback still runs
            self._warn_once(
                "recover",
                f"CUDA state after a failed capture could not be reset ({type(e).__name__}: {e}); random "
                "ops on this device may fail until the process restarts",
            )

    def _replay(self, g: Any) -> None:
        if self.backend == "cuda":
            with torch.cuda.device(self.device):
                g.replay()
        else:
            g()

    def _warn_once(self, what: str, msg: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(msg, stacklevel=4)


def graph_runner(
    cuda_graphs: str | bool,
    device: torch.device,
    max_batch_size: int,
    sizes: Sequence[int] | None,
    compile: str | bool = "auto",
) -> GraphRunner | None:
    """The runner for a runtime's ``cuda_graphs`` / ``cuda_graph_sizes`` / ``compile`` options (None =
    eager). On a CUDA device rounds are CUDA graphs (``cuda_graphs``); elsewhere ``compile=True``
    compiles them (``"auto"`` leaves the CPU eager: compiling costs seconds to minutes per key)."""
    if cuda_graphs not in ("auto", True, False):
        raise ValueError(f"cuda_graphs={cuda_graphs!r}: use 'auto', True or False")
    if compile not in ("auto", True, False):
        raise ValueError(f"compile={compile!r}: use 'auto', True or False")
    if sizes is not None:
        sizes = list(sizes)
        bad = [s for s in sizes if not isinstance(s, int) or not 1 <= s <= max_batch_size]
        if not sizes or bad:
            raise ValueError(f"cuda_graph_sizes={sizes!r}: give batch sizes in [1, max_batch_size={max_batch_size}]")
    if device.type != "cuda" and compile is True:
        return GraphRunner(sizes or default_sizes(max_batch_size), "compile", device)
    if cuda_graphs is False:
        return None
    if device.type != "cuda":
        if cuda_graphs is True:
            warnings.warn(
                f"cuda_graphs=True needs a CUDA device; the runtime is on {device.type}, running eager", stacklevel=3
            )
        return None
    return GraphRunner(sizes or default_sizes(max_batch_size), "cuda", device)
