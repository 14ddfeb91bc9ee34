"""Deterministic mode: every op gives each row a result that does not depend on its batch.

``SpeculativeRuntime(..., deterministic=True)`` wraps the backend's ops in ``DeterministicOps``.
Every op of the target's and the drafter's forward then computes each row (a token of a request)
as a function of that row's own inputs only, bit for bit: not of how many rows share the call,
what the other rows hold, where the row sits, or how the keys it attends to are laid out in the
cache. Two consequences hold by construction:

(a) the logits of every emitted token equal those of plain one-token decoding of the same
    sequence, so speculative greedy output *is* plain greedy output (not "equal unless a
    near-tie rounds differently");
(b) a request's output, greedy or sampled with its seed, is the same alone or in any batch, with
    or without speculation, with any tree shape.

Why the default mode is not row-invariant, and what this module does about it, op by op:

* **Linear layers.** Where ``kernels.cpu_linear`` runs (an AVX-512 or AVX2 + FMA CPU with a C compiler, float32
  or bfloat16, the torch backend) every linear call of every row count goes through it: each output
  element is one fixed instruction sequence, so rows are invariant by construction and nothing is
  probed or padded (probe method ``"kernel"``). Elsewhere: CPU BLAS picks kernels by the row count M:
  on this project's CPU (torch 2.13, MKL, one thread) a 1-row call takes a GEMV path that rounds
  differently from M >= 2 for weights stored ``[K, N]``, and M < 5..16 differ for ``[N, K]`` weights.
  ``probe_min_rows`` finds, per weight shape, layout, dtype and thread count, the smallest M0 from
  which every call is row-invariant (rows drawn at random, 1..64 rows and a few larger counts),
  caches it, and ``linear`` pads smaller calls with zero rows up to M0. An ``[N, K]`` weight whose
  ``[K, N]`` copy needs fewer rows runs on that copy; one with no M0 runs one-row products (every
  row a GEMV) or the fixed-order fallbacks (every call exactly ``max_rows`` rows, else one row at a
  time at row 0 of a fixed block), with a ``DeterminismWarning`` naming the shape. Plain decoding on
  probed ops verifies the root plus a never-accepted padding node (``Decoder.root_tree``,
  ``pad_root``), so its forward runs two rows and needs no padding at all; on the CPU kernels, which
  are row-invariant at one row too (``one_row_invariant``), it runs the root alone. On a GPU the linear layers run
  ``kernels.batch_invariant_matmul`` (one tile configuration, no split-K) instead.
* **Attention.** A query's result must depend only on its sequence of visible keys, but the
  default kernels reduce over cache slots: a verify forward sees its ancestors at scattered tree
  slots, a decode step the same keys contiguous, and SDPA's blocking (and online-softmax
  rescaling) follows the slot layout and the ``kv_len`` bound. Here each query reads its
  *canonical sequence* (the committed prefix, then its visible tree slots in order, as positions
  0..n-1). Where the CPU kernels run (the torch backend, float32/bfloat16, ``cpu_linear``) that is
  ``kernels.cpu_attention``: it reads exactly each query's visible keys, in order, in blocks of 64
  visible keys, so it is row-invariant by construction (probe method ``"kernel"``, still checked end
  to end at load by ``_check_attention``), and prompts run it too as a causal tree after an empty
  prefix. Elsewhere on a CPU it is PyTorch's SDPA (``sdpa_rows``) over keys rounded up to whole key
  blocks (its results then do not depend on the bound) with a row-invariant number of query rows
  (probed: one row alone, or a last block of one row, rounds differently): it reads the cache
  itself when every sequence is a prefix of the slots (one token, a chain, a prompt) and a
  gathered copy per root-to-leaf path for a branching tree (``sequence_layout``). The probe checks
  the composition end to end (``_check_attention``: decode step = chain = tree branch = prompt).
  On a GPU it is ``kernels.det_attention`` (Triton): one program per query and KV head walks the
  query's canonical sequence in blocks of positions anchored at 0 (its prefix slots, then its visible
  tree slots in order), splits of fixed length merged in order, so a query's bits depend on its
  sequence only; prompts are the causal case of the same kernel.
  Where the CPU probe fails, ``chunked_attention`` computes the same definition in fixed order:
  positions in chunks of ``CHUNK`` anchored at 0,

      s = scale * q . k_t  (chunk products of fixed shape, row-invariant)      m = max_t s_t (exact)
      p_t = exp(s_t - m)          [o; l] = sum over chunks, in order, of  p_chunk @ [V_chunk | 1]
      out = o / l                 (no visible key: 0)

  with the chunks wholly inside the committed prefix shared by a row's queries and the rest
  gathered per query; both go through the same fixed-shape chunk products.
* **RMSNorm** runs ``kernels.cpu_norm`` where the CPU kernels run (one fixed order per row).
  Elsewhere it is a per-row reduction whose probe found it row-invariant at any count here
  (otherwise it is padded like ``linear``). The Triton kernel is row-invariant by design.
* **SwiGLU's product** (``ops.silu_mul``): the CPU operator (``kernels.cpu_norm.silu_mul``) runs every
  element by one instruction sequence. Where PyTorch's ``F.silu`` runs instead (the ``cpu_linear="torch"``
  switch), its vectorised CPU kernels compute a tensor's last ``n mod 32`` elements in a scalar tail that
  may round differently, so ``linear`` returns rows at a stride padded to a multiple of ``ALIGN`` when N
  is not one: every row is then processed alike. Intra-op threads split large tensors at size-dependent points, so
  the runtime runs the forwards with one thread on a CPU (``DeterministicOps.threads``); the CPU
  kernels keep the caller's thread count (their results do not depend on it).
* **Sampling** (temperature > 0): the token at absolute position t of a request is the
  exponential race ``argmax_v z_v - log xi_v`` of the processed logits z with noise
  xi ~ Exp(1) hashed from (the request's seed, t, v) (``position_race``). Verification accepts a
  drafted token iff it equals that winner (a greedy walk over the winners), which is lossless:
  the output is the target's sampled sequence, the same with or without speculation.

Examples
--------
>>> rt = ts.SpeculativeRuntime.from_pretrained(t, d, deterministic=True)        # doctest: +SKIP
>>> [p.describe() for p in rt.ops.probes][:2]                                    # doctest: +SKIP
['linear 1536x576 kn float32 cpu x1 thread: min rows 2', ...]
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..kernels import cpu_attention, cpu_linear
from .errors import UserError
from .sampling import mix32

KV_BLOCK = 512  # keys per block of PyTorch's CPU flash attention: calls read whole blocks
# candidate key granularities: the probe keeps the smallest that gives KV_BLOCK's results
KEY_BLOCKS = (64, 128, 256, KV_BLOCK)
SDPA_ROWS = 128  # at most this many query rows (queries x query heads per KV head) per SDPA call (probed up to it)
CHUNK = 64  # keys per chunk of the fixed-order attention (the GPU path and the CPU fallback)
ALIGN = 64  # elements: rows this wide are processed alike by every vectorised elementwise kernel
MAX_ROWS = 64  # the probe tries every row count 1..MAX_ROWS ...
LARGE_ROWS = (96, 160, 256)  # ... and these (prefill calls have many rows)
_PREFILL_SCORES = 1 << 22  # score elements per prefill query block (bounds its memory)
FORWARD_THREADS = 1  # intra-op threads of a deterministic forward on a CPU (``DeterministicOps.threads``)
# devices where the forward's ops run Triton kernels (the batch-invariant matmul, RMSNorm, ``kernels.det_attention``);
# tests add "cpu" to run the GPU's configuration under the interpreter
TRITON_DEVICES = ("cuda",)
_M32 = 0xFFFFFFFF
_RACE_SALT = 0x5BD1E995  # separates the position race's stream from RowRandom's


class DeterminismWarning(UserWarning):
    """An op found no row-invariant call shape here and runs a slower fixed-order fallback."""


@dataclass(frozen=True)
class Probe:
    """What the probe found for one op and shape on this device."""

    op: str  # "linear", "rms_norm", "attention.scores", "attention.values"
    shape: tuple[int, ...]  # linear: (N, K); rms_norm: (H,); attention: the chunk product (K, N)
    layout: str  # linear: "kn" (weight stored [K, N]) or "nk"; else ""
    dtype: str
    device: str
    threads: int
    min_rows: int | None  # pad calls to at least this many rows; None: no count <= the probe's maximum
    fallback: str | None = None  # None, "fixed-chunks" or "per-row" (linear), "fixed-order" (attention)
    skip: tuple[int, ...] = ()  # row counts above min_rows that are not invariant (SDPA: q blocks of one row)
    counts: tuple[int, ...] = ()  # attention: the row counts that are (probed up to SDPA_ROWS; the others are not used)
    method: str = "pad"  # linear: "pad" (to min_rows), "kn" (pad, on a [K, N]-stored copy), "rows" (one-row
    # products), "kernel" (kernels.cpu_linear: every row count, invariant by construction, not probed)
    block: int = 0  # attention: key counts are rounded up to a multiple of this

    def describe(self) -> str:
        shape = "x".join(map(str, self.shape))
        how = f"min rows {self.min_rows}" if self.fallback is None else f"no invariant row count: {self.fallback}"
        how = how if self.min_rows is not None or self.fallback is not None else "no invariant row count"
        if self.block:
            how += f", keys in blocks of {self.block}"
        if self.method == "rows":
            how = f"{how if self.min_rows is not None else 'no invariant row count'}; runs one-row products"
        if self.method == "kernel":
            kernel = {"linear": "cpu_linear", "rms_norm": "cpu_norm", "attention": "cpu_attention"}.get(
                self.op, self.op
            )
            how = f"kernels.{kernel} (row-invariant by construction" + (", checked)" if self.op == "attention" else ")")
        if self.skip:
            how += f", avoiding {_ranges(self.skip)}"
        lay = f" {self.layout}" if self.layout else ""
        return f"{self.op} {shape}{lay} {self.dtype} {self.device} x{self.threads} thread: {how}"


_PROBES: dict[tuple, Probe] = {}  # process-wide cache: (op, shape, layout, dtype, device, threads, torch) -> Probe


def _rows(out: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    outs = out if isinstance(out, tuple) else (out,)
    return tuple(o.reshape(o.shape[0], -1) for o in outs)


def probe_min_rows(
    fn: Callable[[torch.Tensor], torch.Tensor | tuple[torch.Tensor, ...]],
    width: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_rows: int = MAX_ROWS,
    large: Iterable[int] = LARGE_ROWS,
    seed: int = 0,
) -> int | None:
    """The smallest M0 such that ``fn`` is row-invariant for every row count in ``[M0, max_rows]``
    and the ``large`` counts: row r of ``fn(x)`` equals, bit for bit, the same row computed among
    all ``max(large)`` rows, whichever rows share the call and wherever it sits. ``fn`` maps
    ``[M, width]`` to ``[M, ...]`` (or a tuple of such). None when even the largest count differs.

    Each count is tried once with rows drawn at random (a different draw per count), so a result
    holds for this BLAS, CPU, dtype and thread count; the runtime verifies end to end on top.
    """
    counts = list(range(1, max_rows + 1)) + sorted(m for m in set(large) if m > max_rows)
    top = counts[-1]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(top, width, generator=g).to(device=device, dtype=dtype)
    full = _rows(fn(x))
    ok = []
    for m in counts:
        idx = torch.randperm(top, generator=g)[:m].to(x.device)
        ok.append(all(torch.equal(a, f[idx]) for a, f in zip(_rows(fn(x[idx])), full)))
    m0 = None
    for m, good in zip(reversed(counts), reversed(ok)):
        if not good:
            break
        m0 = m
    return m0


@functools.lru_cache(maxsize=256)
def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A shared, never-written zero tensor (made outside inference mode, so any mode may read it)."""
    with torch.inference_mode(False):
        return torch.zeros(shape, dtype=dtype, device=device)


def _pad_rows(x: torch.Tensor, rows: int, dim: int = -2) -> torch.Tensor:
    """``x`` with zero rows appended along ``dim`` up to ``rows`` (x itself when it has enough)."""
    m = x.shape[dim]
    if m >= rows:
        return x
    shape = list(x.shape)
    shape[dim] = rows - m
    return torch.cat([x, _zeros(tuple(shape), x.dtype, x.device)], dim=dim)


def _aligned(out: torch.Tensor) -> torch.Tensor:
    """``out [M, N]`` at a row stride rounded up to ``ALIGN`` elements (a copy) when N is not a
    multiple of it: a vectorised elementwise kernel then treats every row alike (see the module
    docstring), instead of computing the tensor's last ``M*N mod 32`` elements in a scalar tail."""
    m, n = out.shape
    if n % ALIGN == 0 or m <= 1:
        return out
    buf = out.new_empty(m, -(-n // ALIGN) * ALIGN)[:, :n]
    buf.copy_(out)
    return buf


def _one_row_products(
    linear: Callable, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:  # [M, N]
    """``x [M, K] @ weight.T`` with every row computed as a one-row product: M = 1 is the backend's
    own call (a GEMV), M > 1 a ``bmm`` of M one-row items, which BLAS runs as the same GEMV (the
    probe checks it). The bias is added apart, so one and many rows round alike."""
    if x.shape[0] == 1:
        y = linear(x, weight)
    else:
        wt = weight.t()
        y = torch.bmm(x[:, None, :], wt.expand(x.shape[0], *wt.shape))[:, 0]
    return y if bias is None else y + bias


def _weight_layout(weight: torch.Tensor) -> str:
    if cpu_linear.is_packed(weight):
        return "amx" if weight.dim() == 4 else "panels"
    return "kn" if weight.dim() == 2 and weight.stride(0) == 1 and weight.shape[1] > 1 else "nk"


def _version(t: torch.Tensor) -> int:
    """``t._version``; 0 for an inference tensor (weights loaded under ``torch.inference_mode``), which
    keeps no counter and cannot change outside inference mode."""
    return 0 if t.is_inference() else t._version


def _threads(device: torch.device) -> int:
    return torch.get_num_threads() if device.type == "cpu" else 0


# ================================================================== attention
@dataclass
class AttentionLayout:
    """Where each query's canonical key sequence lives, for one forward (every layer shares it).

    ``chunks`` shared chunks cover slots ``[0, chunks * CHUNK)`` of every row; ``shared_ok[b, i, t]``
    says slot t is position t of query i's sequence and is read there. The tail holds the
    positions a query reads elsewhere (its tree ancestors, from the start of the chunk that holds
    the committed prefix's end): ``tail_slot[b, i, j]`` is the slot of position ``tail_start[b] + j``.
    """

    chunks: int
    shared_ok: torch.Tensor  # [B, Q, chunks * chunk] bool
    tail_slot: torch.Tensor | None = None  # [B, Q, n_tail * CHUNK] int64 (0 where not read)
    tail_ok: torch.Tensor | None = None  # [B, Q, n_tail * CHUNK] bool
    chunk: int = CHUNK


def decode_layout(
    prefix_lens: torch.Tensor,  # [B] int64: slots [0, prefix_lens) are the committed prefix
    tree_mask: torch.Tensor,  # [B, Q, T] bool over the tree slots [prefix_lens, prefix_lens + T)
    kv_len: int,  # slots [0, kv_len) may be read
    chunk: int = CHUNK,
    need_tail: bool | None = None,  # None: decide from the mask (a host read; pass True inside a CUDA graph)
) -> AttentionLayout:
    """The canonical sequences of a decode-round forward (a tree, a chain or one token per row).

    A query whose visible tree slots are ``[0, cnt)`` (a chain, the root alone) reads its whole
    sequence ``[0, prefix + cnt)`` through the shared chunks. Any other query (a branch of a tree)
    reads the shared chunks wholly inside its prefix and the rest, ancestors included, as a tail."""
    B, Q, T = tree_mask.shape
    dev = tree_mask.device
    P = prefix_lens[:, None]  # [B, 1]
    cnt = tree_mask.sum(-1)  # [B, Q] visible tree slots
    contig = (tree_mask == (torch.arange(T, device=dev) < cnt[..., None])).all(-1)  # [B, Q]
    start = (P // chunk) * chunk  # [B, 1] first tail position
    end = torch.where(contig, P + cnt, start)  # [B, Q] shared positions [0, end)
    n_chunks = -(-kv_len // chunk)
    shared_ok = torch.arange(n_chunks * chunk, device=dev) < end[..., None]
    if need_tail is None:
        need_tail = not bool(contig.all())
    if not need_tail:
        return AttentionLayout(n_chunks, shared_ok, chunk=chunk)
    n_tail = -(-(chunk - 1 + T) // chunk)
    pos = start[..., None] + torch.arange(n_tail * chunk, device=dev)  # [B, 1, W]
    r = pos - P[..., None]  # position within the tree part
    order = torch.sort((~tree_mask).to(torch.int8), dim=-1, stable=True).indices  # visible tree slots first
    W = pos.shape[-1]
    tree_slot = P[..., None] + order.gather(-1, r.clamp(0, T - 1).expand(B, Q, W))  # [B, Q, W]
    in_prefix = r < 0
    ok = (in_prefix | ((r >= 0) & (r < cnt[..., None]))) & ~contig[..., None]
    slot = torch.where(ok, torch.where(in_prefix, pos, tree_slot), 0)
    return AttentionLayout(n_chunks, shared_ok, slot, ok, chunk)


def causal_layout(batch: int, first: int, last: int, device: torch.device, chunk: int = CHUNK) -> AttentionLayout:
    """The canonical sequences of prompt queries ``first..last-1`` (query p reads keys 0..p)."""
    n_chunks = -(-last // chunk)
    p = torch.arange(first, last, device=device)
    ok = torch.arange(n_chunks * chunk, device=device)[None, :] <= p[:, None]
    return AttentionLayout(n_chunks, ok[None].expand(batch, -1, -1), chunk=chunk)


def _slot_range(src: torch.Tensor, batch: int, n: int) -> torch.Tensor:
    """``src[:batch, :n]`` (float32), zero-padded when ``src`` has fewer than ``n`` slots."""
    x = src[:batch, :n].float()
    if x.shape[1] < n:
        x = torch.cat([x, x.new_zeros(batch, n - x.shape[1], *x.shape[2:])], dim=1)
    return x


def _with_ones(v: torch.Tensor) -> torch.Tensor:
    """``[..., D] -> [..., D+1]`` with a column of ones: ``p @ [V | 1]`` gives the sum of p too."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


def sequential_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` strictly in index order (on a CPU ``cumsum``, a sequential scan accumulated
    in float64; on a GPU an explicit loop, since its scan is parallel): trailing zeros change nothing."""
    if x.device.type == "cpu":
        return x.cumsum(dim).select(dim, -1)
    acc = x.select(dim, 0)
    for i in range(1, x.shape[dim]):
        acc = acc + x.select(dim, i)
    return acc


def fixed_order_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [n, M, K] @ b [n, K, N]`` summed over K strictly in order (``sequential_sum``): row-invariant
    by construction, the fallback when the probe finds no invariant row count for ``torch.bmm``."""
    return sequential_sum(a[..., :, :, None] * b[..., None, :, :], dim=2)


def chunked_attention(
    q: torch.Tensor,  # [B, Q, Hq, D]
    k: torch.Tensor,  # [B_src, S_src, Hkv, D] keys by slot (a layer's cache, or a prompt's new K)
    v: torch.Tensor,  # [B_src, S_src, Hkv, D]
    layout: AttentionLayout,
    scale: float,
    *,
    bmm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.bmm,
    min_rows: int = 1,
) -> torch.Tensor:  # [B, Q, Hq, D]
    """Attention over each query's canonical sequence (module docstring), in float32.

    Every chunk product is a ``bmm`` item of fixed shape (rows x D) @ (D x CHUNK) or
    (rows x CHUNK) @ (CHUNK x D+1) with at least ``min_rows`` rows (the probe's row-invariant
    count), so a chunk's bits do not depend on which queries, rows or items share the call."""
    B, Q, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    C, nC = layout.chunk, layout.chunks
    qg = q.float().view(B, Q, Hkv, G, D).permute(0, 2, 1, 3, 4)  # [B, Hkv, Q, G, D]
    # ---- shared chunks: all queries of a row against slots [0, nC*C)
    ks = _slot_range(k, B, nC * C).view(B, nC, C, Hkv, D)
    kc = ks.permute(0, 3, 1, 4, 2).reshape(B * Hkv * nC, D, C)
    rows = qg.reshape(B, Hkv, 1, Q * G, D).expand(B, Hkv, nC, Q * G, D).reshape(B * Hkv * nC, Q * G, D)
    s = bmm(_pad_rows(rows, min_rows), kc)[:, : Q * G].reshape(B, Hkv, nC, Q, G, C) * scale
    ok = layout.shared_ok.view(B, Q, nC, C).permute(0, 2, 1, 3)[:, None, :, :, None, :]  # [B, 1, nC, Q, 1, C]
    s = torch.where(ok, s, float("-inf"))  # a Python scalar: no tensor, no host copy (capturable)
    m = s.amax(dim=(2, 5))  # [B, Hkv, Q, G]
    # ---- tails: per query, positions gathered from wherever they live
    if layout.tail_slot is not None:
        W = layout.tail_slot.shape[-1]
        nT = W // C
        bidx = torch.arange(B, device=q.device)[:, None, None]
        kt = k[:B][bidx, layout.tail_slot].float()  # [B, Q, W, Hkv, D]
        kt = kt.view(B, Q, nT, C, Hkv, D).permute(0, 4, 1, 2, 5, 3).reshape(B * Hkv * Q * nT, D, C)
        trows = qg[:, :, :, None].expand(B, Hkv, Q, nT, G, D).reshape(B * Hkv * Q * nT, G, D)
        st = bmm(_pad_rows(trows, min_rows), kt)[:, :G].reshape(B, Hkv, Q, nT, G, C) * scale
        okt = layout.tail_ok.view(B, Q, nT, C)[:, None, :, :, None, :]  # [B, 1, Q, nT, 1, C]
        st = torch.where(okt, st, float("-inf"))
        m = torch.maximum(m, st.amax(dim=(3, 5)))
    m = torch.where(m > float("-inf"), m, 0.0)  # a query that sees nothing: p = 0, output 0
    # ---- p @ [V | 1] per chunk, then the chunks summed in sequence order
    p = torch.exp(s - m[:, :, None, :, :, None])  # [B, Hkv, nC, Q, G, C]
    vs = _with_ones(_slot_range(v, B, nC * C)).view(B, nC, C, Hkv, D + 1)
    vc = vs.permute(0, 3, 1, 2, 4).reshape(B * Hkv * nC, C, D + 1)
    o = bmm(_pad_rows(p.reshape(B * Hkv * nC, Q * G, C), min_rows), vc)[:, : Q * G]
    parts = [o.reshape(B, Hkv, nC, Q, G, D + 1).permute(0, 1, 3, 4, 2, 5)]  # [B, Hkv, Q, G, nC, D+1]
    if layout.tail_slot is not None:
        pt = torch.exp(st - m[:, :, :, None, :, None])  # [B, Hkv, Q, nT, G, C]
        vt = _with_ones(v[:B][bidx, layout.tail_slot].float())  # [B, Q, W, Hkv, D+1]
        vt = vt.view(B, Q, nT, C, Hkv, D + 1).permute(0, 4, 1, 2, 3, 5).reshape(B * Hkv * Q * nT, C, D + 1)
        ot = bmm(_pad_rows(pt.reshape(B * Hkv * Q * nT, G, C), min_rows), vt)[:, :G]
        parts.append(ot.reshape(B, Hkv, Q, nT, G, D + 1).permute(0, 1, 2, 4, 3, 5))  # [B, Hkv, Q, G, nT, D+1]
    tot = sequential_sum(torch.cat(parts, dim=4), dim=4)  # [B, Hkv, Q, G, D+1]
    o, l = tot[..., :D], tot[..., D:]
    out = torch.where(l > 0, o / l, 0.0)
    return out.permute(0, 2, 1, 3, 4).reshape(B, Q, Hq, D).to(q.dtype)


# ------------------------------------------------------------------ SDPA over canonical sequences (CPU)
@dataclass
class SequenceLayout:
    """Each query's canonical key sequence as SDPA reads it, for one forward (its layers share it).

    SDPA runs over *items* (a batch entry: a key sequence and the query rows that read it).
    ``visible[item, row, t]``: position t is in that row's sequence (t < its length). When every
    sequence is a prefix of its row's cache slots (one token, a chain, a causal prompt) the items
    are the batch rows, the rows their queries, and SDPA reads the cache itself (``slots`` None).
    Otherwise (a branching tree) an item is one root-to-leaf path: ``slots[item, t]`` is the cache
    slot of its position t, gathered, and its rows are the queries on that path (each query in one
    item), so ``q_index`` / ``out_index`` map between queries and item rows."""

    keys: int  # positions per sequence: a whole number of key blocks
    visible: torch.Tensor  # [items, rows, keys] bool
    slots: torch.Tensor | None = None  # [items, keys] int64 flat slot (row * S + slot), 0 where not read
    q_index: torch.Tensor | None = None  # [items * rows] int64: flat query (b * Q + i) of each item row
    out_index: torch.Tensor | None = None  # [B * Q] int64: flat item row of each query
    padded: torch.Tensor | None = None  # the mask SDPA reads: rows padded to a row-invariant count (see ``pad``)
    folded: bool = False  # SDPA rows are (query, query head of the KV head) pairs (``sdpa_rows``)

    def pad(self, rows: Callable[[int], int], group: int) -> SequenceLayout:
        """With ``padded``, the mask of the SDPA rows (``sdpa_rows``): the item rows when their count
        is row-invariant, else each row repeated for the ``group`` query heads of a KV head (folded),
        then rows that see slot 0 only, up to ``rows(n)``."""
        vis = self.visible
        folded = rows(vis.shape[1]) != vis.shape[1] and group > 1
        vis = vis.repeat_interleave(group, dim=1) if folded else vis
        B, n, keys = vis.shape
        r = rows(n)
        if r > n:
            extra = torch.zeros(B, r - n, keys, dtype=torch.bool, device=vis.device)
            extra[..., 0] = True
            vis = torch.cat([vis, extra], dim=1)
        return replace(self, padded=vis, folded=folded)


def sequence_layout(
    prefix_lens: torch.Tensor,  # [B] int64
    tree_mask: torch.Tensor,  # [B, Q, T] bool
    kv_len: int,
    block: int = KV_BLOCK,
    cache_slots: int = 0,  # S of the cache the slots index (for flat slots)
) -> SequenceLayout:
    """The canonical sequences of a decode-round forward: query i of row b reads the committed
    prefix ``[0, P_b)`` then its visible tree slots in order, as positions ``0..n-1``, padded to
    whole blocks. The tree's paths are worked out on the host (a CPU path: the reads are free)."""
    B, Q, T = tree_mask.shape
    dev = tree_mask.device
    keys = -(-kv_len // block) * block
    t = torch.arange(keys, device=dev)
    vis = [[[j for j, on in enumerate(row) if on] for row in rows] for rows in tree_mask.tolist()]
    if all(v == list(range(len(v))) for rows in vis for v in rows):  # every sequence a prefix of the slots
        cnt = torch.tensor([[len(v) for v in rows] for rows in vis], device=dev)
        return SequenceLayout(keys, t < (prefix_lens[:, None] + cnt)[..., None])
    # group the queries by root-to-leaf path: query i is on path p when p starts with i's slots
    per_row = []  # per batch row: (a leaf's tree slots, the queries on its path)
    for rows in vis:
        leaves: list[tuple[list[int], list[int]]] = []
        for i in sorted(range(Q), key=lambda i: (-len(rows[i]), i)):
            leaf = next((lf for lf in leaves if lf[0][: len(rows[i])] == rows[i]), None)
            if leaf is None:
                leaves.append((rows[i], [i]))
            else:
                leaf[1].append(i)
        per_row.append(leaves)
    n_items = max(len(leaves) for leaves in per_row)
    n_rows = max(len(lf[1]) for leaves in per_row for lf in leaves)
    prefix = prefix_lens.tolist()
    path = [[0] * T for _ in range(B * n_items)]
    length = [[1] * n_rows for _ in range(B * n_items)]  # sequence length per item row (empty rows: slot 0)
    plen, pre, owner = [0] * (B * n_items), [0] * (B * n_items), [0] * (B * n_items)
    q_index, out_index = [0] * (B * n_items * n_rows), [0] * (B * Q)
    for b, leaves in enumerate(per_row):
        for li, (slots, members) in enumerate(leaves):
            it = b * n_items + li
            path[it][: len(slots)] = slots
            plen[it], pre[it], owner[it] = len(slots), prefix[b], b
            for r, i in enumerate(sorted(members)):
                length[it][r] = prefix[b] + len(vis[b][i])
                q_index[it * n_rows + r], out_index[b * Q + i] = b * Q + i, it * n_rows + r
    as_t = functools.partial(torch.tensor, device=dev)
    P, L, W = as_t(pre)[:, None], as_t(plen)[:, None], as_t(owner)[:, None] * cache_slots
    tree_slot = P + as_t(path).gather(1, (t - P).clamp(0, T - 1))
    slots = torch.where(t < P + L, torch.where(t < P, t, tree_slot), 0) + W  # [items, keys] flat
    visible = t < as_t(length)[..., None]  # [items, rows, keys]
    return SequenceLayout(keys, visible, slots, as_t(q_index), as_t(out_index))


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache`` rows at flat slots ``[items, keys]`` (row * S + slot) as ``[items, keys, Hkv, D]``."""
    B, S = cache.shape[:2]
    rows = cache[:B].reshape(B * S, -1).index_select(0, slots.reshape(-1))
    return rows.view(*slots.shape, *cache.shape[2:])


def _block_keys(x: torch.Tensor, batch: int, keys: int) -> torch.Tensor:
    """``x[:batch, :keys]`` (slots), zero-padded (a copy) when the cache holds fewer slots."""
    out = x[:batch, :keys]
    if x.shape[1] < keys:
        out = torch.cat([out, out.new_zeros(batch, keys - out.shape[1], *out.shape[2:])], dim=1)
    return out


def sdpa_rows(
    q: torch.Tensor,  # [B, Q, Hq, D]
    k: torch.Tensor,  # [B, S, Hkv, D] (S a whole number of key blocks)
    v: torch.Tensor,  # [B, S, Hkv, D]
    visible: torch.Tensor,  # [B, R, S] bool: R >= Q rows, or >= Q*G when folded (``SequenceLayout.pad``)
    scale: float,
    folded: bool = False,
) -> torch.Tensor:  # [B, Q, Hq, D]
    """PyTorch SDPA over rows padded with zero queries to ``visible``'s row count. ``folded``: the G
    query heads of each KV head become rows (row ``i*G + g`` is query i's head g; GQA as
    multi-query attention), so one query alone still fills G rows."""
    B, Q, Hq, D = q.shape
    Hkv = k.shape[2]
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    if kt.dtype != q.dtype:
        kt, vt = kt.to(q.dtype), vt.to(q.dtype)
    if not folded:
        rows = q if visible.shape[1] == Q else _pad_rows(q, visible.shape[1], dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            rows.transpose(1, 2), kt, vt, attn_mask=visible[:, None], scale=scale, enable_gqa=Hq != Hkv
        )
        return out.transpose(1, 2) if visible.shape[1] == Q else out.transpose(1, 2)[:, :Q]
    G = Hq // Hkv
    rows = q.view(B, Q, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, Q * G, D)
    out = torch.nn.functional.scaled_dot_product_attention(
        _pad_rows(rows, visible.shape[1]), kt, vt, attn_mask=visible[:, None], scale=scale
    )
    return out[:, :, : Q * G].reshape(B, Hkv, Q, G, D).permute(0, 2, 1, 3, 4).reshape(B, Q, Hq, D)


# ================================================================== sampling
def position_race(
    logits: torch.Tensor,  # [..., V] float32 processed logits (-inf = removed)
    key: torch.Tensor,  # [B] int64 per-request key (sampling.RowRandom.key)
    positions: torch.Tensor,  # [B, ...] int64 absolute position of the token being drawn, logits' leading shape
) -> torch.Tensor:  # [...] int64
    """The exponential race keyed by position: ``argmax_v z_v - log xi_v`` with ``xi_v ~ Exp(1)`` a
    pure hash of (key, position, v), so the token drawn at a position depends on the request's seed,
    the position and the logits only: never on the round, the batch or the tree. Over seeds the
    winner follows ``softmax(z)`` (Gumbel-max). Computed in float64 on rows padded to ``ALIGN``."""
    V = logits.shape[-1]
    Vp = -(-V // ALIGN) * ALIGN
    k = key.view(key.shape[0], *([1] * (positions.dim() - 1)))  # [B, 1, ...]
    base = mix32(k ^ mix32((positions + _RACE_SALT) & _M32))  # [B, ...]
    idx = torch.arange(Vp, device=logits.device)
    h = mix32(mix32((idx + base[..., None]) & _M32) ^ k[..., None])  # [B, ..., Vp]
    u = (h.to(torch.float64) + 0.5) * 2.0**-32
    gumbel = -torch.log(-torch.log(u))
    return (logits.to(torch.float64) + gumbel[..., :V]).argmax(-1)


# ================================================================== the ops proxy
class DeterministicOps:
    """An ``Ops`` proxy (like ``drift.AttentionProbe``): every op runs as ``ops`` runs it, except
    ``linear``, ``rms_norm``, ``tree_attention`` and ``prefill_attention``, which give each row a
    result independent of its batch (module docstring). Discrete ops (verification, KV writes and
    moves, gathers) are exact already and pass through.

    Parameters
    ----------
    ops : the backend's ops (``TorchOps`` or ``TritonOps``).
    device : where the model runs (CPU: the CPU kernels, else probed BLAS and torch; CUDA: Triton kernels: the
        batch-invariant matmul, RMSNorm and ``kernels.det_attention``).
    max_rows : the probe's largest consecutive row count (and the fallback's block size).
    """

    def __init__(self, ops: Any, device: torch.device | str, *, max_rows: int = MAX_ROWS):
        self.ops = ops
        self.name = ops.name
        self.device = torch.device(device)
        self.max_rows = max_rows
        self._layout: tuple | None = None  # (prefix_lens, tree_mask, kv_len, layout) of this forward
        self._causal: tuple | None = None  # ((B, P, device), causal mask, zero prefix) of the last prompt shape
        self._hkv = 1  # KV heads of the attention being run (the SDPA probe's key)
        self._used: dict[tuple, Probe] = {}  # the probes this runtime relies on
        self._fast: dict[Any, tuple] = {}  # per weight / norm shape: what the probe decided (hot-path lookups)
        self._warned: set[tuple] = set()
        self._kernel_threads = torch.get_num_threads()  # kernels.cpu_linear's (``threads()`` keeps the caller's)
        if self.device.type in TRITON_DEVICES:
            try:
                from ..kernels.batch_invariant_matmul import batch_invariant_linear
                from ..kernels.rms_norm import rms_norm
                from ..kernels.utils import require_triton

                require_triton()
            except ImportError as e:
                raise UserError(
                    f"deterministic=True on a GPU needs triton for its batch-invariant matmul ({e}); "
                    "install with `pip install 'tritonspec[triton]'`"
                ) from e
            from ..kernels import det_attention

            self._gpu = (batch_invariant_linear, rms_norm)  # and det_attention's attention
            self._det = det_attention
        elif self.device.type != "cpu":
            raise UserError(f"deterministic=True supports CPU and CUDA devices, not {self.device.type!r}")
        else:
            self._gpu = self._det = None
        self._order: tuple | None = None  # (prefix_lens, tree_mask, kv_len, det_attention.tree_order) of this forward

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ops, name)

    # ------------------------------------------------------------------ probes
    @property
    def probes(self) -> list[Probe]:
        """The probe results this runtime's ops rely on (one per op, shape, dtype and thread count)."""
        return list(self._used.values())

    def _probe(self, key: tuple, run: Callable[[], Probe]) -> Probe:
        full = (*key, FORWARD_THREADS if self.device.type == "cpu" else 0, torch.__version__)
        p = _PROBES.get(full)
        if p is None:
            with self.threads():  # probed as the forwards run: on one thread
                p = _PROBES[full] = run()
        self._used[full] = p
        if p.fallback is not None and full not in self._warned:
            self._warned.add(full)
            warnings.warn(
                f"deterministic mode: {p.describe()} (slower, still row-invariant); the probe found no row "
                f"count from which this op's rows are bit-identical on this machine",
                DeterminismWarning,
                stacklevel=4,
            )
        return p

    def _linear_probe(self, weight: torch.Tensor, bias: torch.Tensor | None, k: int) -> Probe:
        layout = _weight_layout(weight) + ("+bias" if bias is not None else "")
        shape = (cpu_linear.out_features(weight), k)  # [N, K] whatever the storage layout
        kernel = self._kernel_linear(weight, bias)
        key = ("linear", tuple(weight.shape), weight.stride(), bias is not None, k, weight.dtype, self.device.type)
        key += (kernel,)

        def run() -> Probe:
            p = Probe("linear", shape, layout, _dt(weight.dtype), self.device.type, _threads(self.device), 1)
            if kernel:  # kernels.cpu_linear: row-invariant by construction
                return replace(p, method="kernel")
            inner = self.ops.linear
            probe = dict(dtype=weight.dtype, device=weight.device, max_rows=self.max_rows)
            found = probe_min_rows(lambda x: inner(x, weight, bias), k, **probe)
            p = Probe("linear", shape, layout, _dt(weight.dtype), self.device.type, _threads(self.device), found)
            if found is not None and found <= 2:  # pad one-row calls only (plain decoding runs two rows)
                return p
            if _weight_layout(weight) == "nk":  # the same values stored [K, N] (the CPU target's layout)?
                kn = weight.t().contiguous().t()
                found_kn = probe_min_rows(lambda x: inner(x, kn, bias), k, **probe)
                if found_kn is not None and found_kn <= 2:
                    lay = f"{layout}, run as kn (nk: {f'min rows {found}' if found else 'no invariant count'})"
                    return replace(p, layout=lay, min_rows=found_kn, method="kn")
            if probe_min_rows(lambda x: _one_row_products(inner, x, weight, bias), k, **probe) == 1:
                return replace(p, method="rows")  # every row as the (fast) one-row product instead of padding
            if found is not None:
                return p
            fixed = probe_min_rows(lambda x: self._linear_fixed(x, weight, bias, "fixed-chunks"), k, **probe)
            how = "fixed-chunks" if fixed == 1 else "per-row"
            return replace(p, fallback=how, method=how)

        return self._probe(key, run)

    def _kernel_linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether ``kernels.cpu_linear`` runs this weight: the torch backend on a CPU where it builds
        for the dtype (the runtime's ``cpu_linear``), a contiguous ``[N, K]`` weight; always for a weight
        packed for it (``cpu_linear.pack_bf16``, ``pack_panels``: it runs nowhere else)."""
        if cpu_linear.is_packed(weight):
            return True
        return (
            self.device.type == "cpu"
            and self.name == "torch"
            and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.is_contiguous()
            and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous()))
            and self.ops._cpu_kernel(weight.dtype)  # the runtime's cpu_linear choice
        )

    def _cpu_kernels(self, dtype: torch.dtype) -> bool:
        """Whether the CPU kernels (``kernels.cpu_linear``/``cpu_norm``/``cpu_attention``) run ``dtype``
        here: the torch backend on a CPU where they build (the runtime's ``cpu_linear``)."""
        return (
            self._gpu is None
            and self.name == "torch"
            and dtype in (torch.float32, torch.bfloat16)
            and self.ops._cpu_kernel(dtype)
        )

    @property
    def one_row_invariant(self) -> bool:
        """Every probed op gives a one-row call the bits of the same row in a larger call (the CPU
        kernels): plain rounds then need no padding node (``Decoder.pad_root``)."""
        return self._gpu is None and all(
            p.method == "kernel" or (p.min_rows == 1 and p.fallback is None) for p in self._used.values()
        )

    def _norm_probe(self, hidden: int, dtype: torch.dtype, residual: bool) -> Probe:
        key = ("rms_norm", hidden, residual, dtype, self.device.type, self._cpu_kernels(dtype))

        def run() -> Probe:
            if self._cpu_kernels(dtype):  # kernels.cpu_norm: row-invariant by construction
                lay = "+residual" if residual else ""
                return Probe("rms_norm", (hidden,), lay, _dt(dtype), "cpu", _threads(self.device), 1, method="kernel")
            if self.name == "triton":  # one program per row (kernels/rms_norm.py): invariant by design
                found = 1
            else:
                g = torch.Generator().manual_seed(1)
                w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(self.device, dtype)
                inner = self.ops.rms_norm
                fn = (lambda x: inner(x, w, 1e-6, residual=x.flip(-1))) if residual else (lambda x: inner(x, w, 1e-6))
                found = probe_min_rows(fn, hidden, dtype=dtype, device=self.device, max_rows=self.max_rows)
            return Probe(
                "rms_norm",
                (hidden,),
                "+residual" if residual else "",
                _dt(dtype),
                self.device.type,
                _threads(self.device),
                found,
                None if found is not None else "per-row",
            )

        return self._probe(key, run)

    def _chunk_probe(self, head_dim: int) -> int | None:
        """Row-invariant count of the fixed-order attention's chunk products (None: ``fixed_order_bmm``)."""
        if self._gpu is not None:
            return 1
        found = []
        for name, (kk, nn) in (("scores", (head_dim, CHUNK)), ("values", (CHUNK, head_dim + 1))):
            key = ("attention." + name, kk, nn, torch.float32, self.device.type)

            def run(kk=kk, nn=nn, name=name) -> Probe:
                g = torch.Generator().manual_seed(kk * 1000 + nn)
                b = torch.randn(3, kk, nn, generator=g).to(self.device)

                def fn(x: torch.Tensor) -> torch.Tensor:  # the row block as item 0 of a 1..3-item bmm
                    items = 1 + x.shape[0] % 3
                    gi = torch.Generator().manual_seed(x.shape[0])
                    other = torch.randn(items - 1, *x.shape, generator=gi).to(x.device)
                    return torch.bmm(torch.cat([x[None], other]), b[:items])[0]

                m0 = probe_min_rows(fn, kk, device=self.device, max_rows=self.max_rows)
                fb = None if m0 is not None else "fixed-order"
                return Probe(
                    "attention." + name, (kk, nn), "", "float32", self.device.type, _threads(self.device), m0, fb
                )

            found.append(self._probe(key, run).min_rows)
        return None if None in found else max(found)

    def _sdpa_probe(self, hq: int, hkv: int, d: int, dtype: torch.dtype) -> Probe:
        """Which query counts give PyTorch's CPU SDPA row-invariant results for this head shape
        (``min_rows`` and ``skip``), then an end-to-end check of the canonical-sequence attention
        (one token, a chain, a branching tree among other rows, a prompt) against itself; a
        failure selects the fixed-order fallback (``chunked_attention``)."""
        kernel = self._cpu_kernels(dtype) and hkv > 0 and hq % hkv == 0
        kernel = kernel and hq // hkv <= cpu_attention.MAX_GROUP and d <= cpu_attention.MAX_HEAD_DIM
        key = ("attention", hq, hkv, d, dtype, self.device.type, kernel)

        def run() -> Probe:
            if kernel:  # kernels.cpu_attention: each query's visible keys in order, checked end to end
                p = Probe("attention", (hq, hkv, d), "", _dt(dtype), "cpu", _threads(self.device), 1, method="kernel")
                if _check_attention(self, p, hq, hkv, d, dtype):
                    return p
            counts = list(range(1, self.max_rows + 1)) + [m for m in (96, SDPA_ROWS) if m > self.max_rows]
            good = _sdpa_counts(hkv, d, dtype, self.device, counts)
            probe = Probe("attention", (hq, hkv, d), "sdpa", _dt(dtype), self.device.type, _threads(self.device), None)
            if good:
                lo = min(good)
                skip = tuple(c for c in counts if c > lo and c not in good)
                block = _sdpa_block(hkv, d, dtype, self.device, lo)
                probe = replace(probe, min_rows=lo, skip=skip, counts=tuple(good), block=block)
                if _check_attention(self, probe, hq, hkv, d, dtype):
                    return probe
            return replace(probe, min_rows=None, skip=(), fallback="fixed-order")

        return self._probe(key, run)

    def prepare(self, target: Any, drafter: Any = None) -> list[Probe]:
        """Probe every linear weight, norm width and attention head size of the pair now (at load),
        so the first request pays nothing and a fallback warns before any output. Returns the probes."""
        if self._gpu is not None:
            return self.probes
        weights: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for L in target.layers:
            weights += [(L.wqkv, L.bqkv), (L.wo, L.bo), (L.gate_up, None), (L.down, None)]
        weights.append((target.lm_head, None))
        norms = {(target.hidden_size, target.dtype), (target.head_dim, target.dtype)}
        heads = {(target.num_heads, target.num_kv_heads, target.head_dim, target.dtype)}
        if drafter is not None:
            weights += [(m.weight, m.bias) for m in drafter.modules() if isinstance(m, torch.nn.Linear)]
            c, dt = drafter.config, drafter.fc.weight.dtype
            norms |= {
                (c.hidden_size, dt),
                (c.target_hidden_size, dt),
                (c.num_aux_hidden_states * c.target_hidden_size, dt),
            }
            heads.add((c.num_attention_heads, c.num_key_value_heads, c.head_dim, dt))
        for w, b in weights:
            self._linear_probe(w, b, cpu_linear.in_features(w))
        for h, dt in norms:
            for residual in (False, True):
                self._fast[(h, dt, residual)] = self._norm_probe(h, dt, residual)
        if all(p.min_rows == 1 for key, p in self._fast.items() if len(key) == 3 and isinstance(key[0], int)):
            self.rms_norm = self.ops.rms_norm  # every norm of the pair is row-invariant as is: no wrapper
        for hq, hkv, d, dt in heads if self._det is None else ():
            if self._sdpa_probe(hq, hkv, d, dt).fallback is not None:
                self._chunk_probe(d)
        return self.probes

    def native_forward_ops(self, target: Any) -> Any | None:
        """The backend's ops where a decode forward of ``target`` may run as one native operator
        (``kernels.cpu_target``, ``TargetModel._native_weights``), else None: on a CPU where every op of the
        target's forward runs its row-invariant kernel here (its projections' probes say "kernel" when packed
        into panels, which the operator requires; its norms' and attention's probes say so too), that operator
        makes the same kernel calls, so a row's bits are this proxy's. Decided once per target."""
        heads = (target.num_heads, target.num_kv_heads, target.head_dim)
        widths = {target.hidden_size}
        if any(L.q_norm is not None for L in target.layers):  # Qwen3's per-head q/k norms
            widths.add(target.head_dim)
        return self._kernels_only(target, target.dtype, heads, widths)

    def native_drafter_ops(self, drafter: Any) -> Any | None:
        """``native_forward_ops`` for the drafter's native operators (``kernels.cpu_drafter``: its decode step,
        chains, trees and catch-up), by its norms' widths and attention heads. Decided once per drafter."""
        c = drafter.config
        widths = {c.hidden_size, c.target_hidden_size, c.num_aux_hidden_states * c.target_hidden_size}
        heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        return self._kernels_only(drafter, next(drafter.parameters()).dtype, heads, widths)

    def _kernels_only(self, model: Any, dtype: torch.dtype, heads: tuple[int, int, int], widths: set[int]) -> Any:
        """``self.ops`` where ``model``'s attention (``heads``) and its norms of ``widths`` (with and without a
        residual) are probed as the CPU kernels, else None; kept per model object."""
        key = ("native", id(model))
        hit = self._fast.get(key)
        if hit is None or hit[0] is not model:
            ok = self._gpu is None and self._det is None and self.name == "torch" and self._cpu_kernels(dtype)
            if ok:
                probes = [self._sdpa_probe(*heads, dtype)]
                probes += [self._norm_probe(h, dtype, r) for h in widths for r in (False, True)]
                ok = all(p.method == "kernel" for p in probes)
            hit = self._fast[key] = (model, self.ops if ok else None)
        return hit[1]

    @contextlib.contextmanager
    def threads(self) -> Iterator[None]:
        """Run the block with one intra-op thread on a CPU (restored after): several threads split
        large elementwise and reduction kernels at points that depend on the tensor's size. The
        linear layers on ``kernels.cpu_linear`` keep the caller's thread count (its results do not
        depend on it)."""
        n = torch.get_num_threads()
        if self.device.type != "cpu" or n == FORWARD_THREADS:
            yield
            return
        self._kernel_threads = n  # kernels.cpu_linear keeps the caller's threads: its rows do not depend on them
        torch.set_num_threads(FORWARD_THREADS)
        try:
            yield
        finally:
            torch.set_num_threads(n)

    # ------------------------------------------------------------------ ops
    def begin_forward(self, prompt: bool = False) -> None:  # prompts run the same row-invariant ops
        self._layout = self._order = None  # the round updates prefix_lens and the tree mask in place
        if self._gpu is None and torch.get_num_threads() != FORWARD_THREADS and "threads" not in self._warned:
            self._warned.add("threads")
            warnings.warn(
                f"deterministic mode: a forward runs on {torch.get_num_threads()} intra-op threads, but its ops were "
                f"probed on {FORWARD_THREADS}; rt.generate/stream pin it, direct decoder calls need "
                "`with rt.ops.threads():`",
                DeterminismWarning,
                stacklevel=3,
            )
        self.ops.begin_forward()

    def linear(
        self,
        x: torch.Tensor,  # [..., K]
        weight: torch.Tensor,  # [N, K] in the backend's layout
        bias: torch.Tensor | None = None,  # [N]
    ) -> torch.Tensor:  # [..., N]
        """``F.linear`` with rows independent of the call: padded to the probed row count (CPU) or
        the batch-invariant Triton matmul (GPU)."""
        if self._gpu is not None:
            return self._gpu[0](x, weight, bias)
        k = x.shape[-1]
        hit = self._fast.get(id(weight))  # (weight, bias, K, min rows or 0 for a fallback, N aligned)
        if hit is None or hit[0] is not weight or hit[1] is not bias or hit[2] != k:
            p = self._linear_probe(weight, bias, k)
            rows = p.min_rows if p.method in ("pad", "kn") else 0
            w = weight.t().contiguous().t() if p.method == "kn" else weight  # a [K, N]-stored copy, kept
            hit = (weight, bias, k, rows, cpu_linear.out_features(weight) % ALIGN == 0, p.method, w, _version(weight))
            self._fast[id(weight)] = hit
        elif hit[5] == "kn" and hit[7] != _version(weight):  # the weight changed in place: copy it again
            hit = self._fast[id(weight)] = (*hit[:6], weight.t().contiguous().t(), _version(weight))
        rows, aligned, w = hit[3], hit[4], hit[6]
        m = x.numel() // max(k, 1)
        if hit[5] == "kernel":  # every row count, prefill included, through the one row-invariant kernel
            # the weight passed _kernel_linear's checks at its probe; x is the model's activations (its dtype)
            out = cpu_linear.cpu_linear_unchecked(x, weight, bias, self._kernel_threads)
            return out if aligned or m <= 1 else _aligned(out.reshape(m, -1)).view(out.shape)
        if rows and m >= rows:  # already a row-invariant call
            out = self.ops.linear(x, w, bias)
            return out if aligned or m <= 1 else _aligned(out.reshape(m, -1)).view(out.shape)
        x2 = x.reshape(m, k)
        if rows:
            out = self.ops.linear(_pad_rows(x2, rows), w, bias)[:m]
        elif hit[5] == "rows":
            out = _one_row_products(self.ops.linear, x2, weight, bias)
        else:
            out = self._linear_fixed(x2, weight, bias, hit[5])
        return (out if aligned else _aligned(out)).view(*x.shape[:-1], out.shape[-1])

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> [...]
        """``logits.argmax(-1)`` on the caller's thread count (a max and its lowest index do not depend
        on how the vocabulary is split): the verify's head argmax, ~1 ms a call on one thread."""
        n = self._kernel_threads
        if self._gpu is not None or n == torch.get_num_threads():
            return logits.argmax(-1)
        saved = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            return logits.argmax(-1)
        finally:
            torch.set_num_threads(saved)

    def _linear_fixed(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, how: str) -> torch.Tensor:
        """The fallbacks: every call exactly ``max_rows`` rows ("fixed-chunks"), or each row alone at
        row 0 of a zero block of that size ("per-row", invariant by construction)."""
        n = self.max_rows
        if how == "fixed-chunks":
            blocks = [_pad_rows(x[i : i + n], n) for i in range(0, max(x.shape[0], 1), n)]
            return torch.cat([self.ops.linear(b, weight, bias) for b in blocks])[: x.shape[0]]
        outs = [self.ops.linear(_pad_rows(x[i : i + 1], n), weight, bias)[:1] for i in range(x.shape[0])]
        return torch.cat(outs) if outs else self.ops.linear(x, weight, bias)

    def rms_norm(self, x, weight, eps, residual=None):
        """RMSNorm with rows independent of the call (``Ops.rms_norm``)."""
        if self._gpu is not None:
            return self._gpu[1](x, weight, eps, residual)
        key = (x.shape[-1], x.dtype, residual is not None)
        p = self._fast.get(key)
        if p is None:
            p = self._fast[key] = self._norm_probe(*key)
        if p.min_rows == 1:
            return self.ops.rms_norm(x, weight, eps, residual)
        lead, h = x.shape[:-1], x.shape[-1]
        x2, r2 = x.reshape(-1, h), None if residual is None else residual.reshape(-1, h)
        m = x2.shape[0]
        if p.min_rows is None:  # one row at a time
            outs = [
                self.ops.rms_norm(x2[i : i + 1], weight, eps, None if r2 is None else r2[i : i + 1]) for i in range(m)
            ]
            if residual is None:
                return torch.cat(outs).view(*lead, h)
            return torch.cat([o[0] for o in outs]).view(*lead, h), torch.cat([o[1] for o in outs]).view(*lead, h)
        rows = p.min_rows
        out = self.ops.rms_norm(_pad_rows(x2, rows), weight, eps, None if r2 is None else _pad_rows(r2, rows))
        if residual is None:
            return out[:m].view(*lead, h)
        return out[0][:m].view(*lead, h), out[1][:m].view(*lead, h)

    def _attention(self, q: torch.Tensor) -> Probe | tuple[Callable, int]:
        """The SDPA probe when PyTorch's CPU SDPA passed it, else ``(bmm, min_rows)`` of the fixed-order path."""
        key = ("attention", q.shape[2], self._hkv, q.shape[3], q.dtype)
        plan = self._fast.get(key)
        if plan is None:  # (a CPU's: the GPU's attention is det_attention, never probed)
            plan = self._sdpa_probe(*key[1:])
            if plan.fallback is not None:
                m0 = self._chunk_probe(q.shape[3])
                plan = (torch.bmm, m0) if m0 is not None else (fixed_order_bmm, 1)
            self._fast[key] = plan
        return plan

    def tree_attention(self, q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len=None):
        """Attention over each query's canonical sequence (module docstring): ``kernels.det_attention`` on a
        GPU; on a CPU the CPU kernel, PyTorch's SDPA over whole key blocks and row-invariant query counts,
        else ``chunked_attention``. The layout (the GPU's ``tree_order``) is built once per forward (every
        layer passes the same ``prefix_lens``/``tree_mask``)."""
        if self._det is not None:  # kernels.det_attention: canonical sequences by construction
            S = k_cache.shape[1] if kv_len is None else min(int(kv_len), k_cache.shape[1])
            c = self._order
            if c is None or c[0] is not prefix_lens or c[1] is not tree_mask or c[2] != S:
                c = self._order = (prefix_lens, tree_mask, S, self._det.tree_order(prefix_lens, tree_mask, S))
            return self._det.det_tree_attention(q, k_cache, v_cache, prefix_lens, tree_mask, scale, S, order=c[3])
        self._hkv = k_cache.shape[2]
        return self._tree_attention(self._attention(q), q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len)

    def _tree_attention(self, plan, q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len):
        if isinstance(plan, Probe) and plan.method == "kernel":  # the caller's threads: results do not depend on them
            out = cpu_attention.tree_attention(
                q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len, threads=self._kernel_threads
            )
            if out is None:
                raise UserError(
                    f"deterministic mode: the CPU attention kernel does not take q {tuple(q.shape)} {q.dtype} with a "
                    f"{k_cache.dtype} cache of strides {k_cache.stride()}; pass cpu_linear='torch' for the probed path"
                )
            return out
        S = k_cache.shape[1] if kv_len is None else kv_len
        B, Q, Hq, D = q.shape
        G = Hq // k_cache.shape[2]
        c = self._layout
        if c is None or c[0] is not prefix_lens or c[1] is not tree_mask or c[2] != S:
            if isinstance(plan, Probe):
                lay = sequence_layout(prefix_lens, tree_mask, S, plan.block, k_cache.shape[1])
                if lay.slots is not None or Q * G <= SDPA_ROWS:
                    lay = lay.pad(functools.partial(_rows_for, plan), G)
            else:  # the fixed-order fallback (a CPU whose SDPA failed its probe)
                lay = decode_layout(prefix_lens, tree_mask, S)
            c = self._layout = (prefix_lens, tree_mask, S, lay)
        lay = c[3]
        if not isinstance(plan, Probe):
            return chunked_attention(q, k_cache, v_cache, lay, scale, bmm=plan[0], min_rows=plan[1])
        if lay.slots is not None:  # a sequence per root-to-leaf path, gathered: [items, keys, Hkv, D]
            k, v = _gather(k_cache, lay.slots), _gather(v_cache, lay.slots)
            rows = q.reshape(B * Q, Hq, D).index_select(0, lay.q_index).view(k.shape[0], -1, Hq, D)
            out = sdpa_rows(rows, k, v, lay.padded, scale, lay.folded)
            return out.reshape(-1, Hq, D).index_select(0, lay.out_index).view(B, Q, Hq, D)
        k, v = _block_keys(k_cache, B, lay.keys), _block_keys(v_cache, B, lay.keys)  # the cache itself
        if lay.padded is not None:
            return sdpa_rows(q, k, v, lay.padded, scale, lay.folded)
        step, outs = max(1, SDPA_ROWS // G), []
        for i in range(0, Q, step):  # more rows than probed: blocks of queries
            part = SequenceLayout(lay.keys, lay.visible[:, i : i + step]).pad(functools.partial(_rows_for, plan), G)
            outs.append(sdpa_rows(q[:, i : i + step], k, v, part.padded, scale, part.folded))
        return torch.cat(outs, dim=1)

    def prefill_attention(self, q, k, v, scale):
        """The prompt's causal attention as the same canonical computation: on a GPU
        ``det_causal_attention``; on a CPU the CPU kernel (a causal tree after an empty prefix), or blocks
        of queries (at most ``SDPA_ROWS`` rows), each over the whole key blocks up to its last query."""
        if self._det is not None:  # query p over positions 0..p: the canonical sequence of a decode step at p
            return self._det.det_causal_attention(q, k, v, scale)
        self._hkv = k.shape[2]
        return self._prefill_attention(self._attention(q), q, k, v, scale)

    def _prefill_attention(self, plan, q, k, v, scale):
        B, P, Hq, D = q.shape
        if isinstance(plan, Probe) and plan.method == "kernel":  # causal = a tree of P nodes after an empty prefix
            c = self._causal
            if c is None or c[0] != (B, P, q.device):  # built once per prompt shape, not per layer
                mask = torch.ones(P, P, dtype=torch.bool, device=q.device).tril().expand(B, P, P)
                c = self._causal = ((B, P, q.device), mask, torch.zeros(B, dtype=torch.int64, device=q.device))
            return cpu_attention.cpu_tree_attention(q, k, v, c[2], c[1], scale, threads=self._kernel_threads)
        if not isinstance(plan, Probe):
            step = max(CHUNK, (_PREFILL_SCORES // max(B * Hq * -(-P // CHUNK) * CHUNK, 1)) // CHUNK * CHUNK)
            outs = [
                chunked_attention(
                    q[:, i : i + step],
                    k,
                    v,
                    causal_layout(B, i, min(P, i + step), q.device),
                    scale,
                    bmm=plan[0],
                    min_rows=plan[1],
                )
                for i in range(0, P, step)
            ]
            return torch.cat(outs, dim=1)
        G = Hq // k.shape[2]
        blk, step = plan.block, max(1, SDPA_ROWS // G)
        kp, vp = _block_keys(k, B, -(-P // blk) * blk), _block_keys(v, B, -(-P // blk) * blk)
        outs = []
        for i in range(0, P, step):
            last = min(P, i + step)
            keys = -(-last // blk) * blk
            vis = torch.arange(keys, device=q.device) <= torch.arange(i, last, device=q.device)[:, None]
            lay = SequenceLayout(keys, vis.expand(B, -1, -1)).pad(functools.partial(_rows_for, plan), G)
            outs.append(sdpa_rows(q[:, i:last], kp[:, :keys], vp[:, :keys], lay.padded, scale, lay.folded))
        return torch.cat(outs, dim=1)


def _rows_for(probe: Probe, n: int) -> int:
    """The smallest probed row-invariant count >= n (``Probe.counts``; n <= SDPA_ROWS)."""
    return next(c for c in probe.counts if c >= n)


def _sdpa_counts(hkv: int, d: int, dtype: torch.dtype, device: torch.device, counts: list[int]) -> list[int]:
    """The SDPA row counts at which a fixed row's result equals its result among ``max(counts)`` rows
    (random other rows and masks; the row first, in the middle and last; keys over two blocks)."""
    g = torch.Generator().manual_seed(hkv * 100 + d)
    keys = 2 * KV_BLOCK
    k = torch.randn(1, keys, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(1, keys, hkv, d, generator=g).to(device, dtype)
    q0 = torch.randn(hkv, d, generator=g).to(device, dtype)
    own = torch.arange(keys, device=device) < KV_BLOCK + 77

    def row(n: int, at: int) -> torch.Tensor:
        q = torch.randn(1, n, hkv, d, generator=g).to(device, dtype)
        vis = (torch.rand(1, n, keys, generator=g) < 0.5).to(device)
        q[0, at], vis[0, at] = q0, own
        return sdpa_rows(q, k, v, vis, d**-0.5)[0, at]

    ref = row(max(counts), 0)
    return [n for n in counts if all(torch.equal(row(n, at), ref) for at in {0, n // 2, n - 1})]


def _sdpa_block(hkv: int, d: int, dtype: torch.dtype, device: torch.device, rows: int) -> int:
    """The smallest key granularity (``KEY_BLOCKS``) at which SDPA over keys rounded up to it equals
    SDPA over keys rounded up to ``KV_BLOCK`` and to twice that, for lengths across three blocks."""
    g = torch.Generator().manual_seed(hkv * 7 + d)
    k = torch.randn(1, 3 * KV_BLOCK, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(1, 3 * KV_BLOCK, hkv, d, generator=g).to(device, dtype)
    lengths = torch.randint(1, 2 * KV_BLOCK, (24,), generator=g).tolist() + [KV_BLOCK - 1, KV_BLOCK + 1]
    cases = []
    for n in lengths:
        q = torch.randn(1, rows, hkv, d, generator=g).to(device, dtype)
        vis = torch.arange(3 * KV_BLOCK, device=device)[None, None] < n

        def at(keys: int, q=q, vis=vis) -> torch.Tensor:
            return sdpa_rows(q, k[:, :keys], v[:, :keys], vis[:, :, :keys].expand(1, rows, keys), d**-0.5)[0, 0]

        ref = at(-(-n // KV_BLOCK) * KV_BLOCK)
        if not torch.equal(at(-(-n // KV_BLOCK) * KV_BLOCK + KV_BLOCK), ref):
            return KV_BLOCK  # even whole blocks are not invariant: the end-to-end check decides
        cases.append((n, at, ref))
    for blk in KEY_BLOCKS[:-1]:
        if all(torch.equal(at(-(-n // blk) * blk), ref) for n, at, ref in cases):
            return blk
    return KV_BLOCK


def _check_attention(ops: DeterministicOps, probe: Probe, hq: int, hkv: int, d: int, dtype: torch.dtype) -> bool:
    """End-to-end: one query's output is bit-identical as a decode step (two ``kv_len`` bounds), in a
    chain, as a branch of a tree among other rows (ancestors at scattered slots) and in a prompt."""
    g = torch.Generator().manual_seed(7)
    dev = ops.device
    S = 3 * KV_BLOCK

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dev, dtype)

    saved = ops._layout
    try:
        for n in (5, KV_BLOCK - 2, KV_BLOCK + 40):
            L = n - 1  # the query sits at position L and sees keys 0..L
            kc, vc, q0 = rnd(1, S, hkv, d), rnd(1, S, hkv, d), rnd(hq, d)

            def att(q, k, v, prefix, mask, kv_len):
                ops._layout = None
                prefix = torch.tensor(prefix, device=dev)
                return ops._tree_attention(probe, q, k, v, prefix, mask.to(dev), d**-0.5, kv_len)

            one = torch.ones(1, 1, 1, dtype=torch.bool)
            ref = att(q0[None, None], kc, vc, [L], one, L + 1)[0, 0]
            outs = [att(q0[None, None], kc, vc, [L], one, L + 37)[0, 0]]
            qc = rnd(1, 6, hq, d)
            qc[0, 3] = q0
            outs.append(att(qc, kc, vc, [L - 3], torch.ones(6, 6, dtype=torch.bool).tril()[None], L + 3)[0, 3])
            kt, vt = rnd(3, S, hkv, d), rnd(3, S, hkv, d)
            base = L - 3
            kt[1, :base], vt[1, :base] = kc[0, :base], vc[0, :base]
            for j, slot in enumerate((0, 2, 4, 5)):  # the path root -> node 5 at scattered tree slots
                kt[1, base + slot], vt[1, base + slot] = kc[0, base + j], vc[0, base + j]
            mask = torch.rand(3, 8, 8, generator=g) < 0.4
            mask |= torch.eye(8, dtype=torch.bool)
            mask[1, 5] = False
            mask[1, 5, [0, 2, 4, 5]] = True
            qt = rnd(3, 8, hq, d)
            qt[1, 5] = q0
            prefixes = [min(base + 30, S - 9), base, 3]
            outs.append(att(qt, kt, vt, prefixes, mask, max(prefixes) + 8)[1, 5])
            qp = rnd(1, n, hq, d)
            qp[0, L] = q0
            outs.append(ops._prefill_attention(probe, qp, kc[:, :n], vc[:, :n], d**-0.5)[0, L])
            if not all(torch.equal(o, ref) for o in outs):
                return False
        return True
    finally:
        ops._layout = saved


def _ranges(ids: Iterable[int]) -> str:
    """``(33, 65, 97)`` -> ``"33, 65, 97"``; runs of consecutive counts as ``a-b``."""
    ids = sorted(ids)
    out, start = [], ids[0]
    for a, b in zip(ids, [*ids[1:], None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def probe_table(probes: Iterable[Probe]) -> str:
    """A Markdown table of probe results (``DeterministicOps.probes``), one row per op and shape."""
    lines = ["| op | shape | layout | dtype | device | threads | finding |", "|---|---|---|---|---|---|---|"]
    for p in probes:
        shape = "x".join(map(str, p.shape))
        finding = p.describe().split(": ", 1)[1]
        lines.append(f"| {p.op} | {shape} | {p.layout or '-'} | {p.dtype} | {p.device} | {p.threads} | {finding} |")
    return "\n".join(lines)


__all__ = [
    "CHUNK",
    "DeterministicOps",
    "DeterminismWarning",
    "Probe",
    "chunked_attention",
    "decode_layout",
    "causal_layout",
    "position_race",
    "probe_min_rows",
    "probe_table",
]
