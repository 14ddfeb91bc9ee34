"""Which draft-tree shape a request runs when the caller gave none: per batch size and sampling mode.

``SpeculativeRuntime(spec=None)`` asks a ``ShapePolicy`` at every ``generate``/``stream``:
``policy.choose(batch_size, greedy, context)`` returns a ``ShapeChoice`` (the ``SpecConfig``, or None
for plain decoding, and where it came from), reported in ``SpecStats.spec`` / ``spec_source`` and on
the CLI's stats line. ``context`` is the longest prompt of the request, in tokens.

Where the shapes come from, first match wins:

1. the caller's ``spec`` (``source="caller"``): every batch and mode runs it;
2. a tuned profile (``runtime/profiles.py``): the user's for this exact device, then one shipped
   with the package for this device or for this *kind* of device (a CPU profile applies to every
   CPU of the same architecture and vector ISA, e.g. ``cpu-x86_64-avx512``). A profile's
   ``shapes`` table gives the measured best shape per batch size and mode (``tritonspec autotune
   tree --batch-sizes 1,2,4,8``); a batch it did not measure runs the next larger measured batch's
   shape (a batch of 3 the batch-4 row's: it paid on more rows than 3 rows verify with it; 2026-12-06,
   a batch of 4 narrowing as its rows stop), or, above every measured batch (or where plain decoding
   won the larger one), the rule below within the rows the next smaller measured batch verified
   (budget = that batch x its greedy row's ``num_draft_tokens``; plain decoding if plain won that
   row), never a smaller batch's shape on more rows (a batch-1 shape run at batch 4 verifies four
   times its rows: SmolLM2's (3,2,5)+lookup4 ran at 0.49-0.77x of plain decoding there, 2026-12-03);
3. the rule (``source="heuristic"``), derived from the tree tuner's cost model: a verify forward
   costs about one decode step as long as the rows it verifies, summed over the batch, stay within
   the device's *row budget* R (``verify(N) ~ verify(1)`` up to N ~ R on the measured cost curves:
   about 8 on a CPU, where a multi-row matmul soon stops being free, and 64 on a GPU). So a batch
   of B rows verifies ``N = R // B`` tokens per row, shaped as

       greedy    N >= 7: tree (3, 2, min(N, 7)) (CPU) / EAGLE-3's (6, 8, min(N, 48)) family (GPU);
                 2 <= N < 7: a chain of N - 1 tokens;  N < 2: plain decoding
       sampled   a sampled chain of min(N, 5) - 1 tokens (sampled chains are accepted with
                 sum min(p, q), trees of deterministic top-k drafts far less often); N < 2: plain

   A profile's batch-1 shape sets R = its ``num_draft_tokens`` (the budget that device was tuned to).

Long contexts: every verified row attends over the whole context, so a tree that pays on short
prompts can lose on long ones (SmolLM2 on AVX2, ~2,400-token prompts: (3,2,5)+lookup 4 0.84x of plain
decoding, (1,1,2) 1.12x). A profile tuned with ``--long-prompts`` holds rows measured on long
prompts, marked ``"context": T`` (they apply to prompts of at least T tokens; ``contexts`` here:
one sub-policy per threshold, with its own table and budget). A request takes the bucket of the
largest threshold at or below its longest prompt; a bucket's rows and rule work as above.

Short requests on long prompts (CPU): speculation first runs the drafter over every prompt token, which
pays only through the tokens it then drafts. On the demo pair (one thread, 2026-12-07) that pass costs ~14 %
of the target's prompt forward, and the standard set (3,513 prompt tokens over 8 prompts) ran 0.85-0.92x of
plain decoding at 1-8 new tokens a prompt, 1.03x at 16. ``prompt_pass_pays`` decodes plainly a request
whose new tokens fall below ``prompt_pass_ratio`` x its prompt tokens (or that asks for one token, which
the prompt's forward alone gives), a policy-chosen shape only: a caller's ``spec`` always runs.

Adaptive shapes: a profile's batch-1 greedy row also carries a ``ShapeLadder`` (``runtime/adaptive.py``):
the shapes the tuner measured there, among which a request re-chooses between rounds by the
acceptance it shows (``ShapeChoice.ladder``; the engine decides whether it applies). A greedy
request asks the policy again whenever the rows a round runs change (``SpeculativeRuntime._by_width``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .adaptive import ShapeLadder
from .config import SpecConfig

ROW_BUDGET = {"cpu": 8, "cuda": 64}  # rows a verify forward takes at about one decode step's cost
SAMPLED_CHAIN_MAX = 4  # longest sampled chain the rule drafts
# bytes of weights read per FLOP of prompt forward at break-even (prompt_pass_ratio): the demo pair's measured
# break-even, 8-16 new tokens per 439 prompt tokens (0.018-0.036, 0.027 taken), over its drafter's prompt FLOPs
# per target decode byte (0.048): a CPU's memory bandwidth over its prompt FLOP rate, over the fraction of a
# plain step that speculation saves
PROMPT_PASS_BYTES_PER_FLOP = 0.56


def prompt_pass_ratio(drafter_flops_per_token: float, target_bytes_per_step: float) -> float:
    """New tokens per prompt token from which the drafter's pass over the prompt pays on a CPU: the pass costs
    ``drafter_flops_per_token`` (compute-bound) per prompt token, and each new token saves a fraction of a plain
    step that reads ``target_bytes_per_step`` (memory-bound); ``PROMPT_PASS_BYTES_PER_FLOP`` converts."""
    return PROMPT_PASS_BYTES_PER_FLOP * drafter_flops_per_token / max(target_bytes_per_step, 1.0)


def prompt_pass_pays(prompt_tokens: int, new_tokens: int, max_new_tokens: int, ratio: float) -> bool:
    """Whether speculation pays for the drafter's pass over ``prompt_tokens`` (summed over the request's prompts)
    when they ask for ``new_tokens`` in all (``max_new_tokens`` at most a prompt): not for one token a prompt
    (the prompt's forward gives it, nothing is drafted), else from ``ratio`` new tokens per prompt token on."""
    return max_new_tokens > 1 and new_tokens >= ratio * prompt_tokens


@dataclass(frozen=True)
class ShapeChoice:
    """The shape one request runs (None: plain decoding) and where it came from."""

    spec: SpecConfig | None
    source: str  # "caller", "profile", "shipped profile" or "heuristic" (+ " rule" for a row a profile lacks)
    path: str | None = None  # the profile file, when one decided
    ladder: ShapeLadder | None = None  # shapes the request may switch to by its acceptance (runtime/adaptive.py)


def rule_shape(batch_size: int, greedy: bool, budget: int, device_type: str = "cpu") -> SpecConfig | None:
    """The heuristic shape for ``batch_size`` rows under a row ``budget`` (module docstring)."""
    n = budget // max(batch_size, 1)
    if n < 2:
        return None
    if not greedy:
        return SpecConfig.chain(min(n - 1, SAMPLED_CHAIN_MAX))
    if n < 7:
        return SpecConfig.chain(n - 1)
    if device_type == "cuda":
        k = 8 if n >= 32 else 4 if n >= 16 else 2
        return SpecConfig(6, k, min(n, 48, k + 5 * k * k + 1))
    return SpecConfig(3, 2, 7)


@dataclass
class ShapePolicy:
    """Shapes per (batch size, greedy) for one runtime.

    ``table``: ``{(batch_size, "greedy"|"sampled"): SpecConfig | None}`` measured rows (may be
    empty); ``budget``: the row budget of the rule for what the table lacks; ``fixed``: the
    caller's shape, which overrides everything; ``contexts``: ``{T: ShapePolicy}``, the policies
    of prompts of at least T tokens (long-context rows; this policy's own table and budget serve
    shorter prompts); ``ladders``: the measured rows whose requests may re-choose their shape by
    the acceptance they show (``runtime/adaptive.py``)."""

    source: str
    budget: int
    device_type: str = "cpu"
    table: dict[tuple[int, str], SpecConfig | None] = field(default_factory=dict)
    fixed: SpecConfig | None = None
    path: str | None = None
    contexts: dict[int, ShapePolicy] = field(default_factory=dict)  # threshold (prompt tokens) -> its policy
    ladders: dict[tuple[int, str], ShapeLadder] = field(default_factory=dict)  # rows that adapt (runtime/adaptive.py)

    @classmethod
    def caller(cls, spec: SpecConfig) -> ShapePolicy:
        return cls("caller", spec.num_draft_tokens, fixed=spec)

    @classmethod
    def heuristic(cls, device: torch.device) -> ShapePolicy:
        kind = "cuda" if torch.device(device).type == "cuda" else "cpu"
        return cls("heuristic", ROW_BUDGET[kind], kind)

    def choose(self, batch_size: int, greedy: bool, context: int = 0) -> ShapeChoice:
        """The shape for ``batch_size`` rows, greedy or sampled, whose longest prompt has ``context``
        tokens (module docstring)."""
        if self.fixed is not None:
            return ShapeChoice(self.fixed, self.source)
        above = [t for t in self.contexts if t <= context]
        if above:
            t = max(above)
            c = self.contexts[t].choose(batch_size, greedy)
            return ShapeChoice(c.spec, f"{c.source}, context >= {t}", c.path, c.ladder)
        mode = "greedy" if greedy else "sampled"
        rows = sorted(b for b, m in self.table if m == mode and b <= batch_size)
        if rows and rows[-1] == batch_size:  # measured
            spec, ladder = self.table[batch_size, mode], self.ladders.get((batch_size, mode))
            if ladder is not None and spec not in ladder.shapes:
                ladder = None
            return ShapeChoice(spec, self.source, self.path, ladder)
        source = "heuristic" if self.source == "heuristic" else f"{self.source} rule"
        above = sorted(b for b, m in self.table if m == mode and b > batch_size)
        if above and self.table[above[0], mode] is not None:  # between measured batches: the larger one's
            # shape, which paid on more rows than this batch verifies with it (a batch of 4 narrowing to 3)
            return ShapeChoice(self.table[above[0], mode], f"{self.source}, batch {above[0]}'s row", self.path)
        # a batch the table did not measure: a smaller batch's shape would verify more rows than it was
        # measured at (SmolLM2's batch-1 (3,2,5)+lookup4 ran 0.49-0.77x of plain decoding at batch 4), so
        # the rule, within the rows the next smaller measured batch verified (its greedy row's)
        lo = rows[-1] if rows else 1
        if rows and self.table[lo, mode] is None:  # plain decoding won at a smaller batch: more rows cost more
            return ShapeChoice(None, source, self.path)
        if (lo, "greedy") in self.table:
            g = self.table[lo, "greedy"]
            budget = lo * (g.num_draft_tokens if g is not None else 1)
        else:
            budget = lo * self.budget
        return ShapeChoice(rule_shape(batch_size, greedy, budget, self.device_type), source, self.path)

    def largest(self, max_batch_size: int) -> SpecConfig:
        """A shape at least as deep, wide and long as any this policy picks (sizes the caches)."""
        contexts = [0, *self.contexts]
        specs = [
            self.choose(b, g, c).spec for b in range(1, max_batch_size + 1) for g in (True, False) for c in contexts
        ]
        ladders = [*self.ladders.values(), *(lad for p in self.contexts.values() for lad in p.ladders.values())]
        specs += [s for lad in ladders for s in lad.shapes]  # shapes a request may switch to
        specs = [s for s in specs if s is not None] or [SpecConfig.chain(1)]
        d = max(s.num_speculative_tokens for s in specs)
        k = max(s.top_k for s in specs)
        n = max(s.num_draft_tokens for s in specs)
        m = max(s.prompt_lookup_num_tokens for s in specs)
        return SpecConfig(d, k, min(n, k + (d - 1) * k * k + 1) if k > 1 else d + 1, prompt_lookup_num_tokens=m)
