"""Small validated dataclasses: the draft-tree shape, the stats, the generation output."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from .errors import UserError

DEFAULT_LOOKUP_MIN = 2  # SpecConfig.prompt_lookup_min's default (its label names any other value)


@dataclass(frozen=True)
class SpecConfig:
    """Shape of the EAGLE-2 dynamic draft tree (vLLM/SGLang option names).

    Parameters
    ----------
    num_speculative_tokens : draft depth, the longest chain drafted (SGLang ``num_steps``).
    top_k : branching per level (SGLang ``eagle_topk``); 1 drafts a chain.
    num_draft_tokens : tokens the target verifies per round, the root included (as in
        SGLang), so a chain of K drafted tokens has ``num_draft_tokens = K + 1``.
    sample_chain_drafts : for a chain (``top_k=1``) at temperature > 0, draw each draft token from
        the drafter's (processed) distribution q and accept it with probability min(1, p/q),
        resampling a rejection from max(0, p - q) (standard speculative sampling); False keeps the
        deterministic top-1 draft, accepted with probability p. Both are lossless; with a drafter
        distilled on the target's distributions the sampled draft is accepted far more often.
        Greedy decoding and trees (``top_k > 1``) are unaffected.
    prompt_lookup_num_tokens : length of a prompt-lookup branch grafted onto the draft tree
        (``runtime/ngram.py``): the tokens that followed the latest earlier occurrence of the
        sequence's last ``prompt_lookup_max .. prompt_lookup_min`` tokens (vLLM's ``ngram`` method,
        transformers' prompt lookup), verified in the same target forward as the drafter's tree;
        0 (default) drafts with the drafter alone. Not used by the sampled chain
        (``sample_chain_drafts`` at temperature > 0), whose verification needs the drafter's q.
    prompt_lookup_max, prompt_lookup_min : the longest and shortest suffix matched (vLLM names);
        default 3 and 2: a one-token match proposes too often what does not follow (SmolLM2, 6 chat
        prompts: min 1 cost 3% against no lookup, min 2 gained 3%; on HumanEval both gained 20-26%;
        with the run-7 drafters, min 1 gained ~2% τ on both: ``autotune tree --prompt-lookup-min 1,2``
        measures both and writes the faster into the profile).

    The sizes are integers (numpy and torch integers are converted to ``int``); a float, a bool or
    a string raises ``UserError`` naming it, as does a value out of range.

    Examples
    --------
    >>> SpecConfig(num_speculative_tokens=4, top_k=1, num_draft_tokens=5).max_candidates
    4
    """

    num_speculative_tokens: int = 6
    top_k: int = 8
    num_draft_tokens: int = 48
    sample_chain_drafts: bool = True
    prompt_lookup_num_tokens: int = 0
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN

    def __post_init__(self) -> None:
        for name in (
            "num_speculative_tokens",
            "top_k",
            "num_draft_tokens",
            "prompt_lookup_num_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
        ):
            v = getattr(self, name)
            try:  # Python, numpy and torch integers; not floats (2.5), bools or strings
                if isinstance(v, bool):
                    raise TypeError
                object.__setattr__(self, name, operator.index(v))
            except TypeError:
                raise UserError(f"SpecConfig {name}={v!r} must be an integer") from None
        if not isinstance(self.sample_chain_drafts, bool):
            raise UserError(f"SpecConfig sample_chain_drafts={self.sample_chain_drafts!r} must be True or False")
        for name in ("num_speculative_tokens", "top_k"):
            if getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_draft_tokens < 2:
            raise UserError(f"num_draft_tokens={self.num_draft_tokens} must be >= 2 (the root plus at least one draft)")
        if self.num_draft_tokens - 1 > self.max_candidates:
            raise UserError(
                f"num_draft_tokens={self.num_draft_tokens} asks for {self.num_draft_tokens - 1} draft nodes but depth "
                f"{self.num_speculative_tokens} with top_k={self.top_k} drafts only {self.max_candidates} candidates; "
                f"lower num_draft_tokens to <= {self.max_candidates + 1} or raise top_k / num_speculative_tokens"
            )

        if self.prompt_lookup_num_tokens < 0:
            raise UserError(f"prompt_lookup_num_tokens={self.prompt_lookup_num_tokens} must be >= 0 (0: no lookup)")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise UserError(
                f"prompt_lookup_min={self.prompt_lookup_min}, prompt_lookup_max={self.prompt_lookup_max}: "
                "need 1 <= prompt_lookup_min <= prompt_lookup_max"
            )

    @property
    def tree_depth(self) -> int:
        """The deepest node a round verifies: the drafter's depth or the lookup branch's length."""
        return max(self.num_speculative_tokens, self.prompt_lookup_num_tokens)

    @property
    def verify_tokens(self) -> int:
        """Rows of the verify forward: the drafter's tree (root included) plus the lookup branch."""
        return self.num_draft_tokens + self.prompt_lookup_num_tokens

    @property
    def label(self) -> str:
        """``(D,K,N)``, then ``+lookupM`` when the shape has a prompt-lookup branch, ``+lookupMminJ``
        when its ``prompt_lookup_min`` is not the default (tables, logs, the CLI stats line, whose
        fields are split on spaces)."""
        m, j = self.prompt_lookup_num_tokens, self.prompt_lookup_min
        lookup = (f"+lookup{m}" + (f"min{j}" if j != DEFAULT_LOOKUP_MIN else "")) if m else ""
        return f"({self.num_speculative_tokens},{self.top_k},{self.num_draft_tokens})" + lookup

    @property
    def max_candidates(self) -> int:
        """Candidates drafted per round: top_k at level 1, top_k^2 at each deeper level."""
        return self.top_k + (self.num_speculative_tokens - 1) * self.top_k * self.top_k

    @classmethod
    def chain(cls, k: int) -> SpecConfig:
        """A chain of ``k`` drafted tokens (``top_k=1``, ``num_draft_tokens=k+1``)."""
        return cls(num_speculative_tokens=k, top_k=1, num_draft_tokens=k + 1)


PHASES = ("prefill", "draft", "verify", "commit")  # SpecStats.time_split_s keys of eager work


@dataclass
class SpecStats:
    """Speculation metrics, one definition everywhere (vLLM's; ARCHITECTURE §5).

    ``num_drafts``: verify rounds (per row); ``num_draft_tokens``: draft nodes sent to verify;
    ``num_accepted_tokens``: draft tokens accepted; ``accepted_per_position[i]``: rounds in
    which depth i+1 was accepted; ``mean_acceptance_length`` τ = 1 + accepted / drafts (tokens
    per target verify forward, bonus included); ``tokens_per_second`` = new tokens / wall time.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_new_tokens: int = 0
    wall_time_s: float = 0.0
    time_split_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))  # + "graph":
    spec: SpecConfig | None = None  # the shape the request started with (None: plain decoding; adaptive: below)
    spec_source: str = ""  # why: "caller", "profile", "shipped profile", "heuristic", "speculative=False", ...
    #                                                     rounds replayed as CUDA graphs (eager rounds split by phase)
    rows_refilled: int = 0  # continuous batching: prompts admitted into a finished row mid-run
    rows_moved: int = 0  # rows moved down into finished ones once no prompt waits (the round narrows)
    shape_switches: int = 0  # adaptive shapes (runtime/adaptive.py): times a request changed its shape
    rounds_per_shape: dict[str, int] = field(default_factory=dict)  # "(D,K,N)+lookupL" -> rounds (not rows x rounds)

    def count_shape(self, spec: SpecConfig) -> None:
        """Count one round run with ``spec`` (``accepted_per_position`` grows to its depth: a request
        may switch to a deeper shape, ``runtime/adaptive.py``)."""
        key = spec.label
        self.rounds_per_shape[key] = self.rounds_per_shape.get(key, 0) + 1
        self.accepted_per_position += [0] * (spec.tree_depth - len(self.accepted_per_position))

    def count_round(self, accepted: list[int], draft_tokens: int) -> None:
        """Count one verify round of each row that ran it: ``accepted[i]`` draft tokens accepted of
        ``draft_tokens`` sent."""
        for n in accepted:
            self.num_drafts += 1
            self.num_draft_tokens += draft_tokens
            self.num_accepted_tokens += n
            for i in range(n):
                self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def summary(self) -> str:
        split = " ".join(f"{k}={v * 1e3:.0f}ms" for k, v in self.time_split_s.items())
        return (
            f"new_tokens={self.num_new_tokens} tokens/s={self.tokens_per_second:.1f} "
            f"mean_acceptance_length={self.mean_acceptance_length:.2f} rounds={self.num_drafts} [{split}]"
        )


@dataclass
class GenerationOutput:
    """``token_ids``: new tokens per prompt; ``texts``: decoded when a tokenizer is known;
    ``finish_reasons``: ``"stop"`` (a stop token) or ``"length"`` per prompt."""

    token_ids: list[list[int]]
    texts: list[str] | None
    stats: SpecStats
    finish_reasons: list[str]


@dataclass
class StreamPiece:
    """One piece of ``SpeculativeRuntime.stream``: new text and token ids; the last piece also
    carries ``finish_reason`` and ``stats``."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: SpecStats | None = None
