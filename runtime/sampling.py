"""Sampling parameters, logits processing and per-request random streams.

Logits processing (the order transformers uses): ``logits / temperature``, then keep the
``top_k`` largest, then keep the smallest set of tokens whose probability mass reaches
``top_p`` (at least one token). Everything removed gets ``-inf``. The same processing is
applied to the target's logits (the distribution that output follows) and to the drafter's
(so drafted trees rank tokens the target can actually emit).

Random numbers come from one ``torch.Generator`` per request, drawn in a fixed amount per round
(N uniforms and V exponentials), so a request's output depends only on its seed, never on the
batch it runs in.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling settings (vLLM names). ``temperature=0`` is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1] (1 = off)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def process_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """``[..., V]`` float32 logits -> processed logits (``-inf`` outside top-k / top-p)."""
    x = logits.float() / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = x.topk(p.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        mass_before = sorted_x.softmax(-1).cumsum(-1) - sorted_x.softmax(-1)  # mass of strictly better tokens
        drop_sorted = mass_before >= p.top_p
        drop_sorted[..., 0] = False
        x = x.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return x


class RowRandom:
    """One generator per request; ``draw`` gives the round's coins and exponential noise."""

    def __init__(self, seeds: list[int], device: torch.device):
        self.device = device
        self.gens = []
        for s in seeds:
            g = torch.Generator(device=device)
            g.manual_seed(int(s))
            self.gens.append(g)

    def draw(self, n: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(uniforms [B, n], exp_noise [B, vocab])``, row b from generator b."""
        u = torch.stack([torch.rand(n, generator=g, device=self.device) for g in self.gens])
        xi = torch.stack([torch.empty(vocab, device=self.device).exponential_(generator=g) for g in self.gens])
        return u, xi.clamp(min=torch.finfo(torch.float32).tiny)
