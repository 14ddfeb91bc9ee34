"""Row-invariant linear layer for the CPU decode path (issue 21, and issue 16's row invariance).

Math, for x of shape ``[..., K]`` and a weight ``w [N, K]`` stored as loaded (row-major):

    y[m, n] = sum_k x[m, k] * w[n, k]  (+ bias[n])        accumulated in float32, rounded once to x's dtype

Why a kernel of our own: decoding reads every weight once per step, so a one-row matmul should run
at memory speed. PyTorch's CPU one-row bfloat16 ``F.linear`` is compute-bound (5-9 GB/s of weights
on this machine's two cores, against ~25 GB/s for a plain read), and its float32 one-row and
many-row calls round the same row differently (MKL picks another kernel for M = 1 and 2). The C
kernel in ``kernels/cpu/linear.c`` (AVX-512 FMA for float32, AVX512-BF16 ``VDPBF16PS`` for
bfloat16; on AVX2 + FMA CPUs the same source with those intrinsics emulated lane for lane by
``kernels/cpu/avx2.h``, see ``isa()``) streams the weight rows with the next block prefetched,
shares each weight load among up to four rows of x, and computes every output element with the
same instruction sequence whatever the number of rows, the other rows or the thread count: a row's
result is bit-identical in a one-row decode step and in a 64-row verify forward, so speculative
greedy output equals plain greedy output by construction.

Weights packed into 16-column panels (``pack_panels``: ``[N/16, K, 16]``, float32 or bfloat16; the
target's default layout ``weight_layout="panels"`` where ``panels_default`` and the drafter's ``pack_for_cpu``)
run a second kernel, an outer product: each output one fused multiply-add chain over k in ascending
order from +0.0 in float32, then the bias (bfloat16: on the widened values, rounded once at the
end), whatever register tile computes it. Also row-invariant by construction, 0.6-0.75x the
``[N, K]`` kernel's time at 1-3 rows and ~0.5x from 64 rows on SmolLM2's float32 weights, faster
than MKL up to 256 rows; bfloat16 panels stream half the bytes, about half the float32 panels' time
at 1-3 rows (perf/CPU_DECODE.md); a packed weight runs it at every row count.

A prompt's float32 calls of at least ``PROMPT_AMX_ROWS`` rows run a third kernel on CPUs with AMX
(``set_prompt_amx``; ``TRITONSPEC_CPU_PREFILL_AMX=0`` turns it off with the prompt attention's): x and the
weight split exactly into three bfloat16 parts each (``pack_amx3``, cached per weight: 1.5x the float32
weights' bytes), six of the nine part products on the tile unit, accumulated in float32. Float32-class error
(closer to a float64 reference than the panel kernel) at 1.4-2.0x its speed from a few hundred rows; it rounds
differently, so decode rounds and deterministic mode never run it.

It is a C kernel, not Triton, because Triton has no CPU target here. It is built on first use with
the system C compiler (``$CC``, else ``gcc``, else ``cc``; ``-O3 -march=native -fopenmp``, about a
second), cached under ``$TRITONSPEC_CACHE/cpu_kernels`` keyed by the source, the compiler and the
CPU's flags, and loaded with ctypes. OpenMP threads come from the libgomp PyTorch already loaded
(same soname), so the kernel and PyTorch share one pool; the call uses ``torch.get_num_threads()``.

Selection: a runtime's ``cpu_linear`` option (``SpeculativeRuntime(cpu_linear=...)``, ``--cpu-linear``),
whose ``"auto"`` defers to the environment variable ``TRITONSPEC_CPU_LINEAR`` (default ``auto``):
``auto`` uses the kernel where it builds and the CPU has the instructions, else ``F.linear``;
``kernel`` requires it (an error names what is missing); ``torch`` never uses it.
``cpu_linear_status()`` says what ``auto`` chooses here and why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.multiprocessing.reductions import StorageWeakRef

from .store import cache_base

SOURCE = Path(__file__).parent / "cpu" / "linear.c"
# the C sources built into one library: the linear kernel, the decode attention, RMSNorm, rope and KV
# writes, the round's index bookkeeping (kernels/cpu_attention.py, kernels/cpu_norm.py, kernels/cpu_rope.py,
# kernels/cpu_tree.py), causal prefill attention (kernels/cpu_prefill.py)
SOURCES = tuple(
    Path(__file__).parent / "cpu" / f
    for f in ("linear.c", "attention.c", "norm.c", "rope_kv.c", "tree_ops.c", "prefill.c")
)
# included by the sources: part of the build key
HEADERS = tuple(Path(__file__).parent / "cpu" / f for f in ("amx.h", "avx2.h", "bf16.h", "exp.h", "hsum.h"))
OP_SOURCE = Path(__file__).parent / "cpu" / "linear_op.cpp"
MODES = ("auto", "kernel", "torch")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
# Largest row count routed to the kernel by the torch backend: every decode-round call (verify of
# batch x tree rows, drafter steps, plain steps) fits; prefill chunks above it run F.linear.
MAX_ROWS = 256
# ``MAX_ROWS_F32`` (set below ``isa()``): in a prompt's forward (``linear(..., prompt=True)``), float32 calls
# with more rows run F.linear (MKL) on AVX2 CPUs. The kernel's fixed per-output instruction sequence
# (16-lane accumulators, then a reduction tree) runs at ~15-20 G multiply-adds a second per core there,
# MKL's packed GEMM at ~28 G on one thread (54 G on two) once a call is compute-bound
# (perf/CPU_DECODE.md). Measured (2-core AMD EPYC, Zen 3, 2026-12-03, SmolLM2's weights): with
# 2 threads the kernel is faster up to ~48-64 rows, MKL from ~64-96 on (with 1 thread from ~16-32 rows);
# 8 HumanEval prompts (82-125 tokens) prefilled in 2.3-2.6 s through MKL against 3.2-3.3 s through the
# kernel. Decode rounds are not prompts: their calls stay on the kernel up to MAX_ROWS rows, so a
# verify row rounds like a decode step. bfloat16 keeps MAX_ROWS (MKL has no fast bfloat16 path on
# AVX2), AVX-512 CPUs too (not measured there); deterministic mode does not use this dispatch.
# Unpacked ``[N, K]`` weights with fewer elements or columns run F.linear in the default mode: small
# ones sit in cache, so streaming speed buys nothing, and the ``[N, K]`` kernel's per-call cost (~7 us
# from Python) and its per-output horizontal sum over a short K lose to MKL there (the demo target,
# hidden size 128: plain decoding 17% slower through it). SmolLM2's projections (K = 576, 1536; at
# least 576 x 576) are above both. Weights packed into panels (the float32 default layout on AVX-512
# and AVX2 CPUs, ``panels_pay``) run the panel kernel whatever their size, on Intel too since
# 2026-12-06. Deterministic mode runs the kernel for every weight. The floors apply on Intel CPUs only
# (``SIZE_FLOORS``): on AMD (EPYC Zen 3, 2026-12-02) MKL's small calls are slower than the kernel and
# the demo pair decoded faster without them (1 thread, 8 prompts, two runs: plain +11 % / +4 %,
# EAGLE-3.1 +14 % / +33 %, the same tokens).
MIN_WEIGHT = 1 << 18
MIN_K = 256
# Calls with fewer multiply-adds run on one thread (waking a second costs more than it saves; the
# result does not depend on the thread count): the demo target's one-row projections, not SmolLM2's.
SMALL = 1 << 17
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
DTYPES = tuple(_DTYPES)  # the dtypes the CPU kernels run (and pack_panels packs)
# instruction sets the kernels build for (``isa()``): AVX-512 natively (F, BW, VL), or AVX2 + FMA through
# kernels/cpu/avx2.h; bfloat16 dot products run VDPBF16PS where the CPU has AVX512-BF16, else two FMAs
ISAS = {"avx512": ("avx512f", "avx512bw", "avx512vl"), "avx2": ("avx2", "fma")}


class CpuLinearUnavailable(RuntimeError):
    """The kernel cannot run here (no compiler, no AVX-512 or AVX2, ...); the message says why and what to do."""


def cpu_linear_reference(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [..., N], dtype of x
    """``x @ weight.T + bias`` accumulated in float32 (PyTorch), rounded once to ``x``'s dtype."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


def mode() -> str:
    """``TRITONSPEC_CPU_LINEAR``: ``auto`` (default), ``kernel`` or ``torch``."""
    m = os.environ.get("TRITONSPEC_CPU_LINEAR", "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ValueError(f"TRITONSPEC_CPU_LINEAR={m!r} is not one of {MODES}")
    return m


@functools.cache
def cpuinfo(field: str) -> str | None:
    """The first ``field : value`` of ``/proc/cpuinfo`` (None when absent or unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.split(":", 1)[0].strip() == field), None)


@functools.cache  # isa() runs per drafter call (packs_on): the split cost ~8 us
def _cpu_flags() -> frozenset[str]:
    return frozenset((cpuinfo("flags") or "").split())


# An Intel CPU (or one whose vendor cannot be read): what was measured on Intel applies. Decided at
# import (a constant, so torch.compile does not trace the read).
INTEL = (cpuinfo("vendor_id") or "GenuineIntel") == "GenuineIntel"
# Whether ``linear`` sends weights below ``MIN_WEIGHT`` elements or ``MIN_K`` columns to ``F.linear``
# (MKL) in the default mode: on Intel CPUs, where MKL wins on small cache-resident weights; elsewhere
# the kernel runs them too.
SIZE_FLOORS = INTEL


def isa() -> str | None:
    """The instruction set the CPU kernels build for here: ``"avx512"`` (AVX-512 F/BW/VL), ``"avx2"``
    (AVX2 + FMA: the AVX-512 source with its intrinsics emulated on two 256-bit halves, the same values
    by construction) or None (the kernels do not run; ``F.linear`` does)."""
    flags = _cpu_flags()
    return next((name for name, need in ISAS.items() if all(f in flags for f in need)), None)


MAX_ROWS_F32 = 64 if isa() == "avx2" else MAX_ROWS  # see MAX_ROWS; decided at import (a constant under torch.compile)


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "gcc", "cc"):
        if cc and shutil.which(cc):
            return cc
    return None


def cache_dir() -> Path:
    """Where built kernels live: ``$TRITONSPEC_CACHE/cpu_kernels`` (default ``~/.cache/tritonspec``)."""
    return cache_base() / "cpu_kernels"


def _build(out: Path, cmds: list[list[str]], what: str, temps: tuple[str, ...] = ()) -> None:
    """Run ``cmds`` (the last one writes ``{tmp}``), move the result to ``out`` atomically, and
    remove ``{tmp}`` and the intermediate ``temps`` whatever happens."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=out.suffix, dir=out.parent)
    os.close(fd)
    try:
        for cmd in cmds:
            cmd = [a.replace("{tmp}", tmp) for a in cmd]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise CpuLinearUnavailable(f"building {what} with {cmd[0]} failed:\n{r.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent build writes the same bytes
    finally:
        for f in (tmp, *temps):
            if os.path.exists(f):
                os.unlink(f)


def _key(*parts: object) -> str:
    cpu = (sorted(_cpu_flags()), platform.processor())
    src = b"".join(f.read_bytes() for f in (*SOURCES, *HEADERS))
    return hashlib.sha256(src + repr((parts, CFLAGS, cpu)).encode()).hexdigest()[:16]


@functools.cache
def _library() -> ctypes.CDLL:
    """Build (once per source, compiler and CPU) and load the kernel library (ctypes)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise CpuLinearUnavailable(f"the CPU kernels are written for x86-64 (AVX-512, AVX2), not {platform.machine()}")
    if isa() is None:
        raise CpuLinearUnavailable("this CPU has neither AVX-512 (avx512f/bw/vl) nor AVX2 + FMA in /proc/cpuinfo")
    cc = _compiler()
    if cc is None:
        raise CpuLinearUnavailable("no C compiler found (set CC, or install gcc) to build kernels/cpu/linear.c")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    out = cache_dir() / f"linear-{_key(version)}.so"
    if not out.exists():
        _build(out, [[cc, *CFLAGS, "-o", "{tmp}", *map(str, SOURCES)]], ", ".join(f.name for f in SOURCES))
    lib = ctypes.CDLL(str(out))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in ("tritonspec_linear_f32", "tritonspec_linear_bf16", "tritonspec_linear_f32_panels"):
        fn = getattr(lib, name)
        fn.argtypes = [p, i64, i64, p, i64, i64, p, p, i64, ctypes.c_int]
        fn.restype = None
    names = ("tritonspec_linear_bf16_packed", "tritonspec_linear_bf16_panels", "tritonspec_linear_f32_bf16_panels")
    for name in names:  # 0, or why it did not run
        fn = getattr(lib, name)
        fn.argtypes = [p, i64, i64, p, i64, i64, p, p, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
    lib.tritonspec_amx_enabled.argtypes = []
    lib.tritonspec_amx_enabled.restype = ctypes.c_int
    lib.tritonspec_linear_f32_amx3.argtypes = [p, i64, i64, p, i64, i64, p, p, i64, ctypes.c_int]
    lib.tritonspec_linear_f32_amx3.restype = ctypes.c_int
    lib.tritonspec_pack_f32_amx3.argtypes = [p, i64, i64, p, ctypes.c_int]
    lib.tritonspec_pack_f32_amx3.restype = None
    _knob_types(lib)
    for name in ("tritonspec_tree_attention_f32", "tritonspec_tree_attention_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [p, i64, i64, i64, i64, i64, i64, i64, p, p, *[i64] * 7, p, p, *[i64] * 5, ctypes.c_float, p]
        fn.argtypes += [ctypes.c_int]
        fn.restype = ctypes.c_int
    lib.tritonspec_prefill_attention_f32.argtypes = [p, *[i64] * 8, p, *[i64] * 3, p, *[i64] * 3, p, ctypes.c_float]
    lib.tritonspec_prefill_attention_f32.argtypes += [ctypes.c_int]
    lib.tritonspec_prefill_attention_f32.restype = ctypes.c_int
    for name in ("tritonspec_rms_norm_f32", "tritonspec_rms_norm_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [p, i64, p, i64, p, i64, i64, ctypes.c_float, p, p, ctypes.c_int]
        fn.restype = None
    return lib


@functools.cache
def native_op() -> str | None:
    """Build and load ``cpu/linear_op.cpp``: the kernel as the PyTorch operator
    ``torch.ops.tritonspec_cpu.linear`` (no Python frame per call, eager or compiled). None when it
    loaded, else why not (the ctypes path then runs the same kernel)."""
    try:
        _library()
        cxx = next((c for c in (os.environ.get("CXX"), "g++", "c++") if c and shutil.which(c)), None)
        if cxx is None:
            return "no C++ compiler (set CXX, or install g++)"
        from torch.utils.cpp_extension import include_paths

        version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        out = cache_dir() / f"linear_op-{_key(version, OP_SOURCE.read_bytes(), torch.__version__, abi)}.so"
        if not out.exists():
            objs = [str(out.with_suffix(f".{f.stem}.{os.getpid()}.o")) for f in SOURCES]
            lib_dir = str(Path(torch.__file__).parent / "lib")
            c_cmds = [
                [_compiler(), "-O3", "-march=native", "-fopenmp", "-std=gnu11", "-fPIC", "-c", str(f), "-o", o]
                for f, o in zip(SOURCES, objs)
            ]
            cxx_cmd = [cxx, "-O2", "-std=c++17", "-w", "-shared", "-fPIC", "-fopenmp"]
            cxx_cmd += [f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
            cxx_cmd += [*(f"-I{p}" for p in include_paths()), str(OP_SOURCE), *objs, "-o", "{tmp}"]
            cxx_cmd += [f"-L{lib_dir}", "-lc10", "-ltorch_cpu"]
            _build(out, [*c_cmds, cxx_cmd], OP_SOURCE.name, temps=tuple(objs))
        torch.ops.load_library(str(out))
        native = ctypes.CDLL(str(out))  # the same handle: its C functions (set_wide_panel_rows)
        _knob_types(native)
        _native_libs.append(native)
        torch.library.register_fake("tritonspec_cpu::linear")(_fake)
        torch.library.register_fake("tritonspec_cpu::tree_attention")(_fake_attention)
        torch.library.register_fake("tritonspec_cpu::rms_norm")(_fake_norm)
        torch.library.register_fake("tritonspec_cpu::aux_gather")(_fake_aux_gather)
        torch.library.register_fake("tritonspec_cpu::silu_mul")(_fake_silu_mul)
    except (CpuLinearUnavailable, OSError, RuntimeError) as e:
        return str(e)
    return None


_native_libs: list[ctypes.CDLL] = []  # the native operator's library once loaded: it holds its own copy of the kernels


# the C knobs (set one, return the previous) and path counters both copies of the kernels export
KNOBS = (
    "tritonspec_panels_wide_rows",
    "tritonspec_panels_tall_rows",
    "tritonspec_attention_kt",
    "tritonspec_prefill_amx",
    "tritonspec_prompt_linear_amx",
)
COUNTERS = (
    "tritonspec_panels_tall_calls",
    "tritonspec_attention_kt_blocks",
    "tritonspec_prefill_amx_calls",
    "tritonspec_prompt_linear_amx_calls",
)


def _knob_types(lib: ctypes.CDLL) -> None:
    """ctypes signatures of ``KNOBS`` (int -> int) and ``COUNTERS`` (() -> int64) in ``lib``."""
    for name in KNOBS:
        getattr(lib, name).argtypes, getattr(lib, name).restype = [ctypes.c_int], ctypes.c_int
    for name in COUNTERS:
        getattr(lib, name).argtypes, getattr(lib, name).restype = [], ctypes.c_int64


def _count(fn: str) -> int:
    """The C path counter ``fn`` (one of ``COUNTERS``) summed over both copies of the kernels."""
    native_op()
    return int(getattr(_library(), fn)()) + sum(int(getattr(lib, fn)()) for lib in _native_libs)


def set_wide_panel_rows(rows: int) -> int:
    """Run float32 panel calls of at least ``rows`` rows on the AVX-512 tiles (``kernels/cpu/linear.c``
    ``panels512``: 16-lane accumulators, 6 rows x up to 4 panels), 0 never (the 8-lane tiles for every
    row count); returns the previous value (default 6). The two tile sets compute the same bits, so
    this only changes speed: it is here for side-by-side measurements (``perf/CPU_DECODE.md``).
    CPUs without AVX-512 have the 8-lane tiles only (returns 0, sets nothing).

    Example
    -------
    >>> old = set_wide_panel_rows(0)  # doctest: +SKIP
    >>> _ = set_wide_panel_rows(old)  # doctest: +SKIP
    """
    return _set_rows_knob("tritonspec_panels_wide_rows", rows, "the AVX-512 panel tiles")


def set_tall_panel_rows(rows: int) -> int:
    """Run float32 panel calls of 7 up to ``rows`` rows (at most 112; larger values are capped) in tall
    AVX-512 tiles (``kernels/cpu/linear.c`` ``panels512_tall``: up to 14 rows x 2 panels a tile, several
    tiles taking turns over k blocks, so the weights stream once), 0 never (the 6-row tiles, which
    re-read a panel group from cache for each row tile after the first); returns the previous value
    (default 112). The tall tiles are AVX-512 tiles: ``set_wide_panel_rows(0)`` turns them off too.
    ``tall_panel_calls()`` counts the calls that ran them. Same bits either way: it is here for
    side-by-side measurements. CPUs without AVX-512 return 0 and set nothing.

    Example
    -------
    >>> old = set_tall_panel_rows(0)  # doctest: +SKIP
    >>> _ = set_tall_panel_rows(old)  # doctest: +SKIP
    """
    return _set_rows_knob("tritonspec_panels_tall_rows", rows, "the tall panel tiles")


def _set_rows_knob(fn: str, rows: int, what: str) -> int:
    """Set the C knob ``fn`` (one of ``KNOBS``: a row count, or 0 / 1 for a switch) in both copies of the kernels
    (ctypes' and the native operator's); returns the previous value."""
    if rows < 0:
        raise ValueError(f"rows={rows} must be >= 0 (0: never run {what})")
    native_op()
    old = getattr(_library(), fn)(rows)
    for lib in _native_libs:
        getattr(lib, fn)(rows)
    return old


def tall_panel_calls() -> int:
    """How many float32 panel calls ran the tall tiles (``set_tall_panel_rows``) so far in this process,
    through ctypes and the native operator together (0 on CPUs without AVX-512): for tests that must see
    the path taken, since the tiles give the same bits either way."""
    return _count("tritonspec_panels_tall_calls")


@torch.compiler.assume_constant_result
def _native_ready() -> bool:
    """``native_op() is None``, evaluated once at trace time under torch.compile (not traced into)."""
    return native_op() is None


def _fake(x, weight, bias=None, threads=-1):
    return x.new_empty((*x.shape[:-1], out_features(weight)))


def _fake_attention(q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len, threads=-1):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _fake_aux_gather(aux, index, weight, eps):
    return aux.new_empty((index.shape[0], aux.shape[1]))


def _fake_silu_mul(x, threads=-1):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _fake_norm(x, weight, eps, residual=None, threads=-1):
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, (torch.empty_like(y) if residual is not None else x.new_empty((0,)))


@functools.cache
def available(dtype: torch.dtype = torch.float32) -> str | None:
    """None when the kernel runs ``dtype`` here, else why not."""
    if dtype not in _DTYPES:
        return f"dtype {dtype} is not float32 or bfloat16"
    try:
        _library()  # names what is missing: the architecture, the instruction set, a compiler
    except CpuLinearUnavailable as e:
        return str(e)
    return None


@functools.cache
def amx_available() -> str | None:
    """None when packed bfloat16 weights run on AMX here (``pack_bf16``), else why not: the CPU lacks
    AMX-BF16, the kernel library does not build, ``TRITONSPEC_CPU_AMX=0``, or the OS refused the
    tile state. Decided once per process (a process never mixes the AMX and AVX-512 sequences on
    one weight)."""
    missing = [f for f in ("amx_tile", "amx_bf16", "avx512_bf16") if f not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if os.environ.get("TRITONSPEC_CPU_AMX") == "0":
        return "TRITONSPEC_CPU_AMX=0"
    try:
        lib = _library()
    except CpuLinearUnavailable as e:
        return str(e)
    if not lib.tritonspec_amx_enabled():
        return "the OS refused AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return None


def is_packed(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is packed for the CPU kernel: ``pack_bf16`` (AMX, 4-D ``[N/16, K/32, 16, 32]``)
    or ``pack_panels`` (float32 or bfloat16 panels, 3-D ``[N/16, K, 16]``). Only the kernel runs a packed
    weight."""
    return weight.dim() in (3, 4)


def out_features(weight: torch.Tensor) -> int:
    """N of a ``[N, K]`` weight, packed or not."""
    return weight.shape[0] * 16 if weight.dim() in (3, 4) else weight.shape[0]


def in_features(weight: torch.Tensor) -> int:
    """K of a ``[N, K]`` weight, packed or not."""
    return weight.shape[1] * 32 if weight.dim() == 4 else weight.shape[1] if weight.dim() == 3 else weight.shape[-1]


def packable_panels(weight: torch.Tensor) -> bool:
    """Whether ``pack_panels`` takes ``weight``: a float32 or bfloat16 CPU ``[N, K]`` tensor with
    N % 16 == 0 and K > 0, on a machine where the kernels run its dtype (``available()`` is None)."""
    return (
        weight.dim() == 2
        and weight.dtype in _DTYPES
        and weight.device.type == "cpu"
        and weight.shape[0] % 16 == 0
        and weight.numel() > 0
        and available(weight.dtype) is None
    )


def panels_default(dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``weight_layout="auto"`` packs ``dtype`` weights into panels here (and a runtime packs
    a drafter of that dtype), where the panel kernels were measured faster than the ``[N, K]`` one:

    * AVX2 CPUs, float32 and bfloat16 (AMD EPYC Zen 3: float32 0.6-0.75x the ``[N, K]`` kernel's time
      at 1-3 rows, ~0.5x from 64 rows; bfloat16 0.7-0.75x the bfloat16 ``[N, K]`` kernel's time at 1-3
      rows, 0.75-0.95x at 4-128, half the float32 panels' time at 1-3 rows; perf/CPU_DECODE.md);
    * AVX-512 CPUs, float32 only. AMD EPYC Zen 4 (2026-12-04, same process): SmolLM2 float32 plain steps
      0.74-0.89x the ``[N, K]`` layout's time, EAGLE-3.1 rounds 0.79-0.86x, prompts 0.82-0.87x; the demo
      pair's rounds 0.84x. Intel Xeon with AMX (2026-12-05, 2 threads, same process, with the tall tiles of
      ``kernels/cpu/linear.c``): SmolLM2 plain steps 0.98x, EAGLE-3.1 rounds 0.88x, prompts 0.87x (measured on
      that AMX-class Xeon only; ``weight_layout="nk"`` keeps the other layout). bfloat16 stays ``[N, K]`` (AMX
      tiles where the CPU has AMX): on Zen 4 its panel kernel decodes faster (0.80-0.85x) but runs a prompt's
      forward at 1.7x the time of the AVX512-BF16 path ``F.linear`` takes for unpacked weights, which ended
      level end to end.

    ``weight_layout="panels"`` runs the panel kernels on any CPU the kernels build for."""
    here = isa()
    return here == "avx2" or (here == "avx512" and dtype == torch.float32)


def panels_pay(weight: torch.Tensor) -> bool:
    """Whether the panel layout (``weight_layout="panels"``, ``Eagle3Drafter.pack_for_cpu``) packs
    ``weight``: ``packable_panels``, whatever its size. ``SIZE_FLOORS`` no longer applies here (it
    still sends small *unpacked* weights to MKL): on the Intel Xeon with AMX (2026-12-06, one thread,
    same process, the demo pair's 128-wide weights packed against left ``[N, K]`` on MKL; with the native
    chain, which needs packed weights), EAGLE-3.1's decoding took 0.68-0.82x the time on the standard,
    long and perturbed sets at batch 1 and 4, greedy and sampled, plain decoding 0.92-1.04x
    (``perf/CPU_DECODE.md``): the floors had been measured on one-row calls against the ``[N, K]``
    kernel, not on a verify's 4-16 rows against the panels."""
    return packable_panels(weight)


def pack_f32(weight: torch.Tensor) -> torch.Tensor:  # [N/16, K, 16]
    """``weight [N, K]`` in the float32 panel layout (``kernels/cpu/linear.c``): ``wp[p, k, j] =
    w[16 p + j, k]``, so each 16-column panel's k-steps are consecutive 64-byte lines. The packed
    tensor replaces the weight (same bytes); ``linear`` and ``torch.ops.tritonspec_cpu.linear`` run it
    on the outer-product kernel (each output one fused multiply-add chain over k in ascending order,
    row-invariant at any row count, faster than the ``[N, K]`` kernel and than MKL up to 256 rows);
    ``unpack`` gives the ``[N, K]`` values back.

    Example
    -------
    >>> w = torch.randn(32, 64)
    >>> torch.equal(unpack(pack_f32(w)), w)  # doctest: +SKIP
    True
    """
    if weight.dtype != torch.float32:
        raise ValueError(
            f"pack_f32 cannot pack a {weight.dtype} weight into panels: it takes float32 (pack_panels: bfloat16 too)"
        )
    return pack_panels(weight)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:  # [N/16, K, 16]
    """``weight [N, K]`` (float32 or bfloat16) in the panel layout of its dtype (``kernels/cpu/linear.c``).
    float32: ``wp[p, k, j] = w[16 p + j, k]`` (``pack_f32``). bfloat16: the 16 columns of a k-step
    interleaved in pairs, ``wp[p, k, 2 j + h] = w[16 p + 8 h + j, k]`` (j < 8, h < 2), so one 32-byte load
    widens to two 8-lane float32 vectors with a shift and a mask. Either way a panel's k-steps are consecutive
    (64 or 32 bytes each) and the packed tensor replaces the weight (same bytes); ``linear`` runs it on
    the outer-product kernel (bfloat16: the float32 chain on the widened values, rounded once), and
    ``unpack`` gives the ``[N, K]`` values back. The two dtypes' layouts have one shape: pack a
    bfloat16 weight from its ``[N, K]`` values (``pack_panels(unpack(wp).bfloat16())``), never by casting a
    float32 panel (``pack_f32(w).bfloat16()`` would multiply columns in the wrong order).

    Example
    -------
    >>> w = torch.randn(32, 64).bfloat16()
    >>> torch.equal(unpack(pack_panels(w)), w)  # doctest: +SKIP
    True
    """
    if not packable_panels(weight):
        why = available(weight.dtype) or "it needs a float32 or bfloat16 CPU [N, K] weight with N % 16 == 0"
        raise ValueError(f"cannot pack a {weight.dtype} weight of shape {tuple(weight.shape)} into panels: {why}")
    N, K = weight.shape
    if weight.dtype == torch.bfloat16:
        return weight.contiguous().view(N // 16, 2, 8, K).permute(0, 3, 2, 1).contiguous().view(N // 16, K, 16)
    return weight.contiguous().view(N // 16, 16, K).transpose(1, 2).contiguous()


def weight_only_bf16(weight: torch.Tensor) -> torch.Tensor:  # [N/16, K, 16] bfloat16
    """``weight [N, K]`` (float32) rounded to bfloat16 and packed into bfloat16 panels, for float32 inputs:
    ``linear(x, weight_only_bf16(w))`` is bit for bit ``linear(x, pack_f32(w.bfloat16().float()))`` (the float32
    panel kernel's chain on the exactly widened weights, float32 out; ``tritonspec_linear_f32_bf16_panels``)
    on half the bytes. What a float32 drafter's projections use with ``cpu_weight_dtype=torch.bfloat16``:
    lossless speculation only needs the drafter to propose, and one-row calls stream weights at memory speed.

    Example
    -------
    >>> w, x = torch.randn(32, 64), torch.randn(3, 64)
    >>> torch.equal(linear(x, weight_only_bf16(w)), linear(x, pack_f32(w.bfloat16().float())))  # doctest: +SKIP
    True
    """
    if weight.dtype != torch.float32:
        raise ValueError(f"weight_only_bf16 packs a float32 weight for float32 inputs, got {weight.dtype}")
    return pack_panels(weight.bfloat16())


def dtypes_match(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x and weight of one dtype, or float32 x on bfloat16 panels (``weight_only_bf16``)."""
    mixed = weight.dim() == 3 and x.dtype == torch.float32 and weight.dtype == torch.bfloat16
    return weight.dtype == x.dtype or mixed


def packable(weight: torch.Tensor) -> bool:
    """Whether ``pack_bf16`` takes ``weight``: a bfloat16 CPU ``[N, K]`` tensor with N % 16 == 0 and
    K % 32 == 0, on a machine where ``amx_available()`` is None."""
    return (
        weight.dim() == 2
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 32 == 0
        and weight.numel() > 0
        and amx_available() is None
    )


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:  # [N/16, K/32, 16, 32]
    """``weight [N, K]`` in the AMX tile layout (``kernels/cpu/linear.c``): ``wp[nb, kb, p, 2j + i] =
    w[16 nb + j, 32 kb + 2p + i]``, so each 16-column block's k-steps are consecutive 1 KB tiles. The
    packed tensor replaces the weight (same bytes); ``linear`` and ``torch.ops.tritonspec_cpu.linear``
    run it on AMX, row-invariant at any row count; ``unpack_bf16`` gives the ``[N, K]`` values back.

    Example
    -------
    >>> w = torch.randn(32, 64).bfloat16()
    >>> torch.equal(unpack_bf16(pack_bf16(w)), w)  # doctest: +SKIP
    True
    """
    if not packable(weight):
        why = amx_available() or "it needs a bfloat16 CPU [N, K] weight with N % 16 == 0 and K % 32 == 0"
        raise ValueError(f"cannot pack a {weight.dtype} weight of shape {tuple(weight.shape)} for AMX: {why}")
    N, K = weight.shape
    w = weight.contiguous().view(N // 16, 16, K // 32, 16, 2)
    return w.permute(0, 2, 3, 1, 4).contiguous().view(N // 16, K // 32, 16, 32)


def unpack(weight: torch.Tensor) -> torch.Tensor:  # [N, K]
    """The ``[N, K]`` values of a ``pack_bf16`` or ``pack_panels`` weight (a copy, or a view of a single
    panel: do not write into it; a slice of whole blocks or panels unpacks to their rows); any other
    tensor is returned as is."""
    if weight.dim() == 3:
        P, K = weight.shape[:2]
        if weight.dtype == torch.bfloat16:  # pairs interleaved: [P, K, 8, 2] -> [P, 2, 8, K]
            return weight.reshape(P, K, 8, 2).permute(0, 3, 2, 1).reshape(P * 16, K)
        return weight.transpose(1, 2).reshape(P * 16, K)
    if weight.dim() != 4:
        return weight
    NB, KB = weight.shape[:2]
    return weight.reshape(NB, KB, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(NB * 16, KB * 32)


unpack_bf16 = unpack  # the name before float32 panels existed


# A prompt's float32 calls of at least this many rows run on AMX in three-part bfloat16 splits
# (``kernels/cpu/linear.c`` ``tritonspec_linear_f32_amx3``; ``set_prompt_amx``). One thread, Xeon with AMX
# (2026-12-06): faster than the panel kernel from ~16 rows on the demo's shapes and ~32 on SmolLM2's, 1.4-2.0x at
# 400-2,400 rows; on two threads from ~64 (fewer rows split thinly over two threads). perf/CPU_DECODE.md.
# The choice goes by the call's rows, so in the default mode a short prompt prefilled alone (under 64 rows) and
# in a batch (64+) can round differently in the last bits, as with MKL above; deterministic mode never runs it.
PROMPT_AMX_ROWS = 64
_amx3_cache: dict = {}  # _amx3_key -> (storage weak reference, version, packed parts): _amx3_weight


def pack_amx3(weight: torch.Tensor) -> torch.Tensor:  # [N/16, K/32, 3, 16, 32] int16 (bfloat16 bits)
    """A float32 ``weight [N, K]`` (or its ``pack_panels`` form) split exactly into three bfloat16 parts
    ``w = w0 + w1 + w2`` (``w0``: ``w`` truncated to bfloat16, ``w1``: the remainder truncated, ``w2``: what is
    left, exact in bfloat16 down to 2^-126), in the AMX tile layout of ``kernels/cpu/linear.c``:
    ``wp[nb, kb, t, p, 2 j + i]`` = the bits of part ``t`` of ``w[16 nb + j, 32 kb + 2 p + i]``. What a
    prompt's float32 calls run on AMX (``set_prompt_amx``); 1.5x the float32 weight's bytes. Packed by the C
    library where it loads (~4x ``pack_amx3_reference``'s speed: SmolLM2's projections in ~0.25 s), else by the
    reference; the same bits either way.

    Example
    -------
    >>> w = torch.randn(32, 64)
    >>> parts = pack_amx3(w).view(torch.bfloat16).float()  # [2, 2, 3, 16, 32]
    >>> torch.equal(parts.sum(2).view(2, 2, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(32, 64), w)
    True
    """
    w = unpack(weight)
    if w.dtype != torch.float32 or w.dim() != 2 or w.shape[0] % 16 or w.shape[1] % 32:
        raise ValueError(
            f"pack_amx3 takes a float32 [N, K] weight with N % 16 == 0 and K % 32 == 0, not {w.dtype} {tuple(w.shape)}"
        )
    try:
        lib = _library()
    except CpuLinearUnavailable:
        return pack_amx3_reference(w)
    N, K = w.shape
    w = w.contiguous()
    out = torch.empty(N // 16, K // 32, 3, 16, 32, dtype=torch.int16)
    lib.tritonspec_pack_f32_amx3(w.data_ptr(), N, K, out.data_ptr(), torch.get_num_threads())
    return out


def pack_amx3_reference(weight: torch.Tensor) -> torch.Tensor:  # [N/16, K/32, 3, 16, 32] int16
    """``pack_amx3`` in PyTorch ops (``weight``: float32 ``[N, K]``, N % 16 == 0, K % 32 == 0)."""
    N, K = weight.shape
    top = torch.tensor(-65536, dtype=torch.int32)  # 0xffff0000: sign, exponent and 7 significand bits
    w = weight.contiguous()
    w0 = (w.view(torch.int32) & top).view(torch.float32)
    r = w - w0  # exact
    w1 = (r.view(torch.int32) & top).view(torch.float32)
    parts = torch.stack([w0, w1, r - w1])  # [3, N, K], each exact in bfloat16
    bits = (parts.view(torch.int32) >> 16).to(torch.int16)
    bits = bits.view(3, N // 16, 16, K // 32, 16, 2).permute(1, 3, 0, 4, 2, 5)
    return bits.contiguous().view(N // 16, K // 32, 3, 16, 32)


def set_prompt_amx(on: bool) -> bool:
    """Run a prompt's float32 projections of at least ``PROMPT_AMX_ROWS`` rows on AMX (``pack_amx3`` weights,
    packed on first use and cached, 1.5x the float32 weights' bytes) or on the panel/``[N, K]`` kernels;
    returns the previous setting. On by default where AMX runs (``amx_available()``;
    ``TRITONSPEC_CPU_PREFILL_AMX=0`` starts a process with it off, as for the prompt attention); elsewhere
    it stays off (returns False). The two paths round differently (prompts only: decode rounds and deterministic
    mode never run it; a short prompt alone and in a batch may take different paths), so this is here for
    side-by-side measurements and tests. Turning it off frees the cached parts.

    Example
    -------
    >>> old = set_prompt_amx(False)  # doctest: +SKIP
    >>> _ = set_prompt_amx(old)  # doctest: +SKIP
    """
    prev = bool(_set_rows_knob("tritonspec_prompt_linear_amx", int(on), "the AMX prompt projections"))
    if not _prompt_amx():
        _amx3_cache.clear()
    return prev


def prompt_amx_calls() -> int:
    """How many calls ran the AMX prompt path (``set_prompt_amx``) so far in this process: for tests."""
    return _count("tritonspec_prompt_linear_amx_calls")


def _prompt_amx() -> bool:
    """The switch as the C library holds it (``kernels/cpu/amx.h`` ``prompt_amx_set``: -1 only asks), the one
    place that reads ``TRITONSPEC_CPU_PREFILL_AMX`` and whether AMX runs."""
    return bool(_library().tritonspec_prompt_linear_amx(-1))


def _amx3_key(weight: torch.Tensor) -> tuple:
    """Where ``weight``'s values live: views made afresh per call (a slice of packed panels) share one entry."""
    return (weight.untyped_storage().data_ptr(), weight.storage_offset(), tuple(weight.shape), tuple(weight.stride()))


def _amx3_version(weight: torch.Tensor) -> object:
    """What tells an in-place write: the version counter, or for an inference tensor (which keeps none) the bytes of
    256 values spread over it (a write that changes none of them goes unseen; the runtime never writes its weights
    in place in inference mode)."""
    if not weight.is_inference():
        return weight._version
    flat = weight.reshape(-1)
    return hash(flat[:: max(1, flat.numel() // 256)].contiguous().numpy().tobytes())


def _amx3_weight(weight: torch.Tensor) -> torch.Tensor:
    """``pack_amx3(weight)``, cached per storage, offset, shape and strides while the storage lives (a weak
    reference: a freed storage whose address comes back is packed afresh) and until it is written in place
    (``_amx3_version``: the version counter, shared by a tensor and its views). Entries of freed storages go at the
    next miss."""
    key, version = _amx3_key(weight), _amx3_version(weight)
    hit = _amx3_cache.get(key)
    if hit is not None and not hit[0].expired() and hit[1] == version:
        return hit[2]
    for k, v in list(_amx3_cache.items()):  # a snapshot: another thread may insert meanwhile
        if v[0].expired():
            _amx3_cache.pop(k, None)
    packed = pack_amx3(weight)
    _amx3_cache[key] = (StorageWeakRef(weight.untyped_storage()), version, packed)
    return packed


def _prompt_linear_amx(
    x: torch.Tensor,  # [..., K] float32
    weight: torch.Tensor,  # [N, K] or [N/16, K, 16] (panels) float32
    bias: torch.Tensor | None,  # [N] float32
) -> torch.Tensor | None:  # [..., N], or None: another kernel runs the call
    """A prompt's float32 call on AMX (``set_prompt_amx``) where it applies, else None."""
    K = x.shape[-1]
    if weight.dim() == 3 and weight.dtype == torch.float32:
        N = weight.shape[0] * 16
    elif weight.dim() == 2 and weight.dtype == torch.float32 and weight.shape[1] == K:
        N = weight.shape[0]
    else:
        return None
    if (
        K % 32
        or N % 16
        or not _prompt_amx()
        or (bias is not None and (bias.dtype != torch.float32 or bias.shape != (N,)))
        or torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (x, weight, bias))
        or torch.compiler.is_compiling()
        or get_proxy_mode() is not None
        or isinstance(x, FakeTensor)
    ):
        return None
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    wp = _amx3_weight(weight)
    y = torch.empty(M, N, dtype=torch.float32)
    b = None if bias is None else bias.contiguous()
    rc = _library().tritonspec_linear_f32_amx3(
        x2.data_ptr(), M, x2.stride(0), wp.data_ptr(), N, K, None if b is None else b.data_ptr(), y.data_ptr(), N,
        torch.get_num_threads(),
    )  # fmt: skip
    if rc == -2:
        raise MemoryError(f"the AMX prompt kernel could not allocate its split rows ({M} x {K})")
    return y.view(*x.shape[:-1], N) if rc == 0 else None


def enabled(dtype: torch.dtype, choice: str = "auto") -> bool:
    """Whether the torch backend routes CPU ``linear`` calls of ``dtype`` to the kernel. ``choice``:
    a runtime's ``cpu_linear`` option; ``"auto"`` defers to ``TRITONSPEC_CPU_LINEAR`` (``mode()``)."""
    if choice not in MODES:
        raise ValueError(f"cpu_linear={choice!r} is not one of {MODES}")
    m = mode() if choice == "auto" else choice
    if m == "torch":
        return False
    why = available(dtype)
    if why is not None and m == "kernel":
        raise CpuLinearUnavailable(
            f"cpu_linear='kernel' (or TRITONSPEC_CPU_LINEAR=kernel) but {why}; use 'auto' to fall back to F.linear"
        )
    return why is None


def cpu_linear_status() -> dict[str, str]:
    """Per dtype: ``"kernel"`` or ``"torch (<why>)"`` under the current ``TRITONSPEC_CPU_LINEAR``."""
    m = mode()
    out = {}
    for dt, name in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        why = "TRITONSPEC_CPU_LINEAR=torch" if m == "torch" else available(name)
        out[dt] = "kernel" if why is None else f"torch ({why})"
    return out


def cpu_linear(
    x: torch.Tensor,  # [..., K] float32 or bfloat16, CPU
    weight: torch.Tensor,  # [N, K] contiguous, dtype of x
    bias: torch.Tensor | None = None,  # [N] contiguous, dtype of x
    threads: int | None = None,
) -> torch.Tensor:  # [..., N]
    """``x @ weight.T + bias`` with the row-invariant CPU kernel (see the module docstring);
    ``threads`` defaults to ``torch.get_num_threads()`` (one below ``SMALL`` multiply-adds); the
    result does not depend on it.

    Example
    -------
    >>> w, x = torch.randn(7, 99), torch.randn(3, 99)
    >>> torch.allclose(cpu_linear(x, w), x @ w.T, atol=1e-4)  # doctest: +SKIP
    True
    """
    K = x.shape[-1]
    N = out_features(weight)
    if x.dtype not in _DTYPES or not dtypes_match(x, weight) or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(
            f"cpu_linear takes float32 or bfloat16 x, weight and bias of one dtype (or float32 x and bias with "
            f"bfloat16 panels, weight_only_bf16), got {x.dtype}, {weight.dtype}, {None if bias is None else bias.dtype}"
        )
    if weight.dim() == 3:
        if tuple(weight.shape[1:]) != (K, 16) or not weight.is_contiguous():
            raise ValueError(
                f"a panel-packed weight {tuple(weight.shape)} ({weight.dtype}) does not match {x.dtype} x with "
                f"K={K} (pack_panels of a {x.dtype} [N, {K}])"
            )
    elif is_packed(weight):
        if tuple(weight.shape[1:]) != (K // 32, 16, 32) or K % 32 or not weight.is_contiguous():
            raise ValueError(f"a packed weight {tuple(weight.shape)} does not match x's K={K} (pack_bf16 of [N, {K}])")
    elif weight.dim() != 2 or weight.shape[1] != K or not weight.is_contiguous():
        raise ValueError(
            f"cpu_linear needs a contiguous [N, K={K}] weight, got {tuple(weight.shape)} with strides {weight.stride()}"
        )
    if bias is not None and (bias.shape != (N,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{N}] tensor, got {tuple(bias.shape)}")
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError("cpu_linear runs on CPU tensors")
    return _launch(x, weight, bias, threads)


def cpu_linear_unchecked(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] contiguous, dtype of x
    bias: torch.Tensor | None = None,  # [N] contiguous, dtype of x
    threads: int | None = None,
) -> torch.Tensor:  # [..., N]
    """``cpu_linear`` without its per-call argument checks, for a caller that checked the weight once
    (deterministic mode: ~3 us a call saved on every projection)."""
    return _launch(x, weight, bias, threads)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int | None) -> torch.Tensor:
    """The call itself, arguments already checked: the native operator where it loaded (~4.6 us a
    call from Python), else ctypes (~6 us)."""
    if _native_ready():
        return torch.ops.tritonspec_cpu.linear(x, weight, bias, -1 if threads is None else threads)
    return _launch_ctypes(x, weight, bias, threads)


def _launch_ctypes(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int | None
) -> torch.Tensor:
    K = x.shape[-1]
    N = out_features(weight)
    y = torch.empty((*x.shape[:-1], N), dtype=x.dtype)
    if not x.is_contiguous():  # rows at one stride, unit stride along K
        x = x.reshape(-1, K)
        if K and x.stride(-1) != 1:
            x = x.contiguous()
        ldx = x.stride(0)
    else:
        ldx = K
    M = y.numel() // N if N else 0
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.copy_(bias.expand_as(y)) if bias is not None else y.zero_()
    lib = _library()
    fn = lib.tritonspec_linear_f32 if x.dtype == torch.float32 else lib.tritonspec_linear_bf16
    if weight.dim() == 3 and x.dtype != weight.dtype:  # weight-only bfloat16 (weight_only_bf16)
        fn = lib.tritonspec_linear_f32_bf16_panels
    elif weight.dim() == 3:
        fn = lib.tritonspec_linear_f32_panels if x.dtype == torch.float32 else lib.tritonspec_linear_bf16_panels
    elif is_packed(weight):
        fn = lib.tritonspec_linear_bf16_packed
    rc = fn(
        x.data_ptr(), M, ldx, weight.data_ptr(), N, K,
        None if bias is None else bias.data_ptr(), y.data_ptr(), N,
        threads if threads is not None else (torch.get_num_threads() if M * N * K >= SMALL else 1),
    )  # fmt: skip
    if weight.dim() == 4 and rc != 0:
        raise CpuLinearUnavailable(
            "the weight is packed for AMX but AMX is off in this process: load it with weight_layout='nk'"
        )
    if weight.dim() == 3 and x.dtype == torch.bfloat16 and rc != 0:
        raise MemoryError(f"the bfloat16 panel kernel could not allocate the float32 copy of x ({M} x {K})")
    return y


@torch.library.custom_op("tritonspec::cpu_linear", mutates_args=())
def _cpu_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _launch(x, weight.contiguous(), None if bias is None else bias.contiguous(), None)


@_cpu_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], out_features(weight)))


def linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    prompt: bool = False,
) -> torch.Tensor:  # [..., N]
    """The CPU kernel where it applies (``x`` and ``weight`` of one dtype, a contiguous ``[N, K]``
    weight of at least ``MIN_WEIGHT`` elements and ``MIN_K`` columns where ``SIZE_FLOORS``, no
    autograd, at most ``MAX_ROWS`` rows, or ``MAX_ROWS_F32`` in a float32 ``prompt`` forward), else
    ``F.linear``. ``prompt``: the call belongs to a prompt's forward (``meta.prefill``), whose rows
    need not round like a decode step's; decode rounds (verify, drafter and plain steps) keep every
    call up to ``MAX_ROWS`` rows on the kernel, so their rows stay invariant. The caller
    has checked that ``x`` is a float32/bfloat16 CPU tensor and ``enabled(x.dtype)``. While a graph is traced
    (``torch.compile``, ``make_fx``) the kernel is an opaque operator (``tritonspec_cpu::linear``,
    else the Python custom op ``tritonspec::cpu_linear``), so compiled and eager rounds compute the
    same bits. A packed weight (``pack_bf16``, ``pack_panels``) always runs the kernel (any row count; no
    autograd). A float32 ``prompt`` call of at least ``PROMPT_AMX_ROWS`` rows runs on AMX where it runs
    (``set_prompt_amx``)."""
    if prompt and x.dtype == torch.float32 and x.numel() >= PROMPT_AMX_ROWS * max(x.shape[-1], 1):
        y = _prompt_linear_amx(x, weight, bias)
        if y is not None:
            return y
    if is_packed(weight):
        bad_bias = bias is not None and bias.dtype != x.dtype
        if not dtypes_match(x, weight) or in_features(weight) != x.shape[-1] or bad_bias:
            raise ValueError(
                f"a packed {weight.dtype} weight {tuple(weight.shape)} (K={in_features(weight)}) does not match "
                f"{x.dtype} x with K={x.shape[-1]}" + ("" if bias is None else f" and a {bias.dtype} bias")
            )
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            raise ValueError(
                "a packed weight (AMX, panels) has no autograd: load the model with weight_layout='nk' to train"
            )
    elif (
        weight.dtype != x.dtype
        or (SIZE_FLOORS and (weight.numel() < MIN_WEIGHT or x.shape[-1] < MIN_K))
        or x.numel() > (MAX_ROWS_F32 if prompt and x.dtype == torch.float32 else MAX_ROWS) * x.shape[-1]
        or not weight.is_contiguous()
        or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))
        or (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)))
    ):
        return F.linear(x, weight, bias)
    tracing = torch.compiler.is_compiling() or get_proxy_mode() is not None or isinstance(x, FakeTensor)
    if tracing and not _native_ready():  # ctypes cannot be traced: the Python custom op stands in
        return _cpu_linear_op(x, weight, bias)
    return _launch(x, weight, bias, None)  # the native operator is traced and compiled as one


def _fixed_values(n: int, seed: int) -> torch.Tensor:  # [n] float32 in [-1, 1)
    """Inputs that are the same on every machine: an integer hash (exact int64 arithmetic) scaled to
    float32, not a random generator whose vectorised path could differ by CPU."""
    i = torch.arange(n, dtype=torch.int64) + seed * 1_000_003
    h = (i * 2654435761 + 12345) % (1 << 32)
    return (h.to(torch.float64) / 2**31 - 1.0).to(torch.float32)


def kernel_digest(dtype: torch.dtype = torch.float32) -> str:
    """sha256 (16 hex digits) of the CPU kernels' outputs on a fixed battery of inputs (linear layers
    of 1 to 7 and 64 rows over odd and SmolLM2-like shapes, on ``[N, K]`` weights and on
    ``pack_panels`` panels; tree and decode attention with GQA,
    RMSNorm with a residual), in ``dtype``. The kernels are one instruction sequence per output, and
    ``kernels/cpu/avx2.h`` emulates the AVX-512 one lane for lane, so two machines whose digests
    match compute these kernels bit for bit alike; compare the value across CPUs (``perf/CPU_DECODE.md``
    records the ones measured). Raises ``CpuLinearUnavailable`` where the kernels do not run.

    Example
    -------
    >>> kernel_digest(torch.float32)  # doctest: +SKIP
    'c0ffee...'
    """
    from . import cpu_attention, cpu_norm

    why = available(dtype)
    if why is not None:
        raise CpuLinearUnavailable(why)
    h = hashlib.sha256()

    def put(t: torch.Tensor) -> None:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())

    seed = 0
    for n, k, rows in ((13, 99, (1, 5)), (576, 576, (1, 3, 64)), (50, 1536, (1, 4)), (7, 33, (2,))):
        seed += 1
        w = _fixed_values(n * k, seed).view(n, k).to(dtype)
        b = (_fixed_values(n, seed + 100) * 0.1).to(dtype)
        for m in rows:
            put(cpu_linear(_fixed_values(m * k, seed + m).view(m, k).to(dtype), w, b, threads=1))
    # the outer-product kernel on panels (pack_panels: weight_layout="panels")
    for n, k, rows in ((48, 99, (1, 2, 5)), (576, 576, (1, 3, 4, 64)), (64, 1536, (1, 6, 7))):
        seed += 1
        w = pack_panels(_fixed_values(n * k, seed).view(n, k).to(dtype))
        b = (_fixed_values(n, seed + 100) * 0.1).to(dtype)
        for m in rows:
            put(cpu_linear(_fixed_values(m * k, seed + m).view(m, k).to(dtype), w, b, threads=1))
    for hq, hkv, d, s_len, q_len in ((9, 3, 64, 40, 6), (4, 4, 32, 70, 1), (8, 2, 48, 20, 3)):
        seed += 1
        kc = _fixed_values(2 * s_len * hkv * d, seed).view(2, s_len, hkv, d).to(dtype)
        vc = _fixed_values(2 * s_len * hkv * d, seed + 1).view(2, s_len, hkv, d).to(dtype)
        q = _fixed_values(2 * q_len * hq * d, seed + 2).view(2, q_len, hq, d).to(dtype)
        prefix = torch.tensor([s_len - q_len - 5, s_len // 2], dtype=torch.int64)
        mask = torch.tril(torch.ones(q_len, q_len, dtype=torch.bool)).expand(2, q_len, q_len).contiguous()
        put(cpu_attention.cpu_tree_attention(q, kc, vc, prefix, mask, d**-0.5, threads=1))
    x, r = _fixed_values(5 * 576, 90).view(5, 576).to(dtype), _fixed_values(5 * 576, 91).view(5, 576).to(dtype)
    y, s = cpu_norm.cpu_rms_norm(x, (_fixed_values(576, 92) + 1.5).to(dtype), 1e-5, r, threads=1)
    put(y)
    put(s)
    return h.hexdigest()[:16]
