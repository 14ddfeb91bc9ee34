"""Sampling parameters, logits processing and per-request random streams.

Logits processing (the order transformers uses): ``logits / temperature``, then keep the
``top_k`` largest, then keep the smallest set of tokens whose probability mass reaches
``top_p`` (at least one token). Everything removed gets ``-inf``. The same processing is
applied to the target's logits (the distribution that output follows) and to the drafter's
(so drafted trees rank tokens the target can actually emit).

Random numbers are counter-based: the draw for (request seed, round counter, index) is a pure
integer hash (``RowRandom``), computed with tensor ops (eager CPU rounds: one C operator,
``kernels.cpu_tree.row_random``, the same bits) from a per-row key and counter that live
in device tensors. So a request's output depends only on its seed, never on the batch it runs
in, and the draws need no ``torch.Generator``: a captured CUDA graph replays them as it replays
everything else (the counter advances on the device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import cpu_tree
from .errors import UserError

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): ``logits / temperature`` overflows
# float32 for tiny temperatures (1e-38 gives inf - inf = NaN in the softmax), and the limit
# temperature -> 0 of sampling is greedy decoding anyway.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling settings (vLLM names). ``temperature=0`` is greedy, and so is any
    temperature below ``GREEDY_TEMPERATURE`` (1e-5): temperature -> 0 approaches greedy output."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise UserError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p={self.top_p} must lie in (0, 1] (1 = off)")
        if self.top_k < 0:
            raise UserError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise UserError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")

    @property
    def greedy(self) -> bool:
        """Greedy decoding: ``temperature`` below ``GREEDY_TEMPERATURE`` (0 included)."""
        return self.temperature < GREEDY_TEMPERATURE


def process_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """``[..., V]`` float32 logits -> processed logits (``-inf`` outside top-k / top-p)."""
    x = logits.float()
    if p.temperature != 1.0:  # x / 1 is x: one op less a call at temperature 1
        x = x / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = x.topk(p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        p_sorted = sorted_x.softmax(-1)
        mass_before = p_sorted.cumsum(-1) - p_sorted  # mass of strictly better tokens
        drop_sorted = mass_before >= p.top_p
        drop_sorted[..., 0] = False
        x = x.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return x


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2^32`` for int64 ``x`` in [0, 2^32) and a 32-bit constant ``c``, without
    int64 overflow: the product is split at bit 16 so every partial product stays below 2^49."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (Wellons' ``lowbias32``) on int64 tensors in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


class RowRandom:
    """Per-request counter-based random numbers, graph-safe.

    Row b's draw number j of round r is ``h = mix32(mix32((j + mix32(k_b ^ mix32(r))) mod 2^32) ^ k_b)``
    with ``k_b`` a 32-bit key hashed from the row's 64-bit seed. ``key`` and ``counter`` are
    ``[B]`` int64 device tensors (pass views of static buffers to keep them at fixed addresses);
    ``draw`` reads them and advances ``counter`` in place, with no host synchronisation.
    """

    def __init__(
        self,
        seeds: list[int],
        device: torch.device,
        key: torch.Tensor | None = None,
        counter: torch.Tensor | None = None,
    ):
        self.device = device
        B = len(seeds)
        self.key = torch.empty(B, dtype=torch.int64, device=device) if key is None else key
        self.counter = torch.empty(B, dtype=torch.int64, device=device) if counter is None else counter
        if self.key.shape != (B,) or self.counter.shape != (B,):
            raise ValueError(
                f"key/counter buffers must have shape ({B},), got {tuple(self.key.shape)} / {tuple(self.counter.shape)}"
            )
        words = [(v & _M32, v >> 32) for v in (int(x) & (2**64 - 1) for x in seeds)]  # seed -> two 32-bit words
        s = torch.tensor(words, dtype=torch.int64).reshape(B, 2)
        k = mix32(s[:, 0] ^ mix32(s[:, 1] ^ 0x9E3779B9))
        self.key.copy_(k.to(device))
        self.counter.zero_()

    def rows(self, start: int, stop: int) -> RowRandom:
        """The streams of rows ``start..stop-1``: views of the same key/counter tensors (not reseeded)."""
        sub = object.__new__(RowRandom)
        sub.device, sub.key, sub.counter = self.device, self.key[start:stop], self.counter[start:stop]
        return sub

    def hashes(self, n: int, vocab: int) -> torch.Tensor:
        """The round's 32-bit words ``h [B, n + vocab]`` (int64): ``n`` coins, then ``vocab`` noise words."""
        dev = self.key.device
        base = mix32(self.key ^ mix32(self.counter & _M32))  # [B]
        idx = torch.cat([torch.arange(n, device=dev), torch.arange(vocab, device=dev) + 2**31])  # coins, then noise
        return mix32(mix32((idx[None, :] + base[:, None]) & _M32) ^ self.key[:, None])

    def draw(self, n: int, vocab: int, native: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(uniforms [B, n] in [0, 1), exp_noise [B, vocab] > 0)`` for this round; counter += 1.
        ``native``: the whole draw as one C call (``kernels.cpu_tree.row_random``) where it runs (eager CPU
        calls; the same bits and counter: 30 us against ~380 for ``hashes`` and the ops below on the demo
        drafter's 8,192 words), else ``hashes``."""
        out = cpu_tree.row_random(self.key, self.counter, n, vocab) if native else None
        if out is not None:
            return out
        h = self.hashes(n, vocab)
        u = (h[:, :n] >> 8).to(torch.float32) * 2.0**-24  # 24 bits: exact in float32, < 1
        e = -torch.log((h[:, n:].to(torch.float64) + 0.5) * 2.0**-32)  # Exp(1) from 32 bits, > 0
        self.counter.add_(1)
        return u, e.to(torch.float32).clamp(min=torch.finfo(torch.float32).tiny)
