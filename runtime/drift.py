"""Attention-drift diagnostics: what EAGLE-3.1 fixes, measured on the drafter a user has.

For each draft depth k (the drafter forward whose logits propose the depth-k token), over a
prompt set, we record:

* the drafter's attention mass on the **sink** (the first ``n_sink`` cache slots), on the rest
  of the **context** (the committed prefix: the prompt and the tokens accepted so far) and on its
  own **drafted** tokens of this round (the tree region, itself included), averaged over heads,
  queries and rounds;
* the RMS of the **carried hidden state** that step produces (EAGLE-3 carries the pre-norm ``h``,
  whose size can grow with depth; EAGLE-3.1 carries ``norm(h)``);
* the **acceptance rate** at depth k: rounds in which depth k was accepted / rounds.

Depth 1 is the catch-up's last position (it sees only committed tokens); depth k >= 2 are the
tree steps. Collecting diagnostics computes the attention probabilities a second time on the side
and never changes the generated tokens.

Examples
--------
>>> report = measure_drift("target_dir", ["eagle3_dir", "eagle31_dir"], prompts)   # doctest: +SKIP
>>> report.drafters[0].attn_drafted      # per depth                                 # doctest: +SKIP
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..kernels.tree_attention import tree_visibility
from .config import SpecConfig


@dataclass
class DrifterCurves:
    """Per-depth curves for one drafter (index 0 = depth 1)."""

    name: str
    fc_norm: bool
    norm_output: bool
    attn_sink: list[float] = field(default_factory=list)
    attn_context: list[float] = field(default_factory=list)
    attn_drafted: list[float] = field(default_factory=list)
    carry_rms: list[float] = field(default_factory=list)
    acceptance: list[float] = field(default_factory=list)
    mean_acceptance_length: float = 1.0
    samples: list[int] = field(default_factory=list)  # query observations per depth


@dataclass
class DriftReport:
    drafters: list[DrifterCurves]
    spec: dict
    num_prompts: int
    n_sink: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def summary(self) -> str:
        lines = []
        for d in self.drafters:
            lines.append(
                f"{d.name} (fc_norm={d.fc_norm}, norm_output={d.norm_output}): tau={d.mean_acceptance_length:.2f}"
            )
            lines.append("  depth  sink   context drafted carry_rms accept")
            for k in range(len(d.carry_rms)):
                lines.append(
                    f"  {k + 1:>5}  {d.attn_sink[k]:.3f}  {d.attn_context[k]:.3f}   {d.attn_drafted[k]:.3f}"
                    f"   {d.carry_rms[k]:>8.3f}  {d.acceptance[k]:.3f}"
                )
            if len(d.carry_rms) > 1:
                lines.append(
                    f"  drafted share {d.attn_drafted[0]:.3f} -> {d.attn_drafted[-1]:.3f}, "
                    f"carry RMS {d.carry_rms[0]:.3f} -> {d.carry_rms[-1]:.3f} "
                    f"(x{d.carry_rms[-1] / max(d.carry_rms[0], 1e-12):.2f})"
                )
        return "\n".join(lines)


class DriftRecorder:
    """Accumulates attention shares and carry norms per depth: a ``runtime.decode.DraftObserver``.

    ``wrap(ops)`` gives the drafter's forwards ops that also record each attention's
    probabilities (``AttentionProbe``); the decoder then reports each drafter forward
    (``on_catch_up``, ``on_depth1``, ``on_step``) and the recorder reads the recorded attention.
    Use it through ``SpeculativeRuntime.observe(recorder)``."""

    def __init__(self, depth: int, n_sink: int = 1):
        self.n_sink = n_sink
        self.sums = torch.zeros(depth, 4, dtype=torch.float64)  # sink, context, drafted, carry_rms
        self.counts = torch.zeros(depth, dtype=torch.float64)
        self._probe: AttentionProbe | None = None
        self._depth1: tuple | None = None  # (attention [B, Hq, 1, S], prefix lens) of the last catch-up

    def wrap(self, ops: Any) -> AttentionProbe:
        if self._probe is None or self._probe.ops is not ops:
            self._probe = AttentionProbe(ops)
        return self._probe

    def on_catch_up(self, last: torch.Tensor, prefix_lens: torch.Tensor) -> None:
        """The catch-up's query ``last [B]`` of each row is depth 1 of the next round."""
        attn = self._probe.last  # [B, Hq, Qc, S]
        B = last.shape[0]
        idx = last.reshape(B, 1, 1, 1).expand(B, attn.shape[1], 1, attn.shape[-1])
        self._depth1 = (attn.gather(2, idx), prefix_lens)

    def on_depth1(self, carry: torch.Tensor, active: torch.Tensor) -> None:
        attn, prefix = self._depth1
        self.observe(1, attn, prefix, carry, active)

    def on_step(self, depth: int, prefix_lens: torch.Tensor, carry: torch.Tensor, active: torch.Tensor) -> None:
        self.observe(depth, self._probe.last, prefix_lens, carry, active)

    def observe(
        self, depth: int, attn: torch.Tensor, prefix_lens: torch.Tensor, carry: torch.Tensor, active: torch.Tensor
    ) -> None:
        """``attn [B, Hq, Q, S]`` probabilities, ``carry [B, Q, H]``, ``active [B]`` bool: one depth's queries."""
        S = attn.shape[-1]
        slot = torch.arange(S, device=attn.device)
        p = attn.double().mean(1)  # [B, Q, S], averaged over heads
        sink = p[..., : self.n_sink].sum(-1)
        prefix = (slot[None, :] < prefix_lens[:, None])[:, None, :]  # [B, 1, S]
        context = (p * prefix).sum(-1) - sink
        drafted = (p * ~prefix).sum(-1)
        rms = carry.double().pow(2).mean(-1).sqrt()
        w = active[:, None].expand_as(sink).double()
        stats = torch.stack([sink, context, drafted, rms], -1)  # [B, Q, 4]
        self.sums[depth - 1] += (stats * w[..., None]).sum((0, 1)).cpu()
        self.counts[depth - 1] += w.sum().cpu()

    def curves(self) -> torch.Tensor:
        return self.sums / self.counts.clamp(min=1)[:, None]


class AttentionProbe:
    """An ``Ops`` proxy: every op runs as ``ops`` runs it; the two attention ops also keep the
    attention probabilities ``[B, Hq, Q, S]`` (float32) they applied in ``last``. An extra
    computation on the side that never changes the outputs."""

    def __init__(self, ops: Any):
        self.ops = ops
        self.last: torch.Tensor | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ops, name)

    def tree_attention(self, q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len=None):
        out = self.ops.tree_attention(q, k_cache, v_cache, prefix_lens, tree_mask, scale, kv_len)
        S = k_cache.shape[1] if kv_len is None else kv_len
        self.last = _probabilities(q, k_cache[: q.shape[0], :S], tree_visibility(prefix_lens, tree_mask, S), scale)
        return out

    def prefill_attention(self, q, k, v, scale):
        out = self.ops.prefill_attention(q, k, v, scale)
        P = k.shape[1]
        causal = torch.ones(P, P, dtype=torch.bool, device=q.device).tril().expand(q.shape[0], P, P)
        self.last = _probabilities(q, k, causal, scale)
        return out


def _probabilities(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) over the ``visible [B, Q, S]`` keys: q ``[B, Q, Hq, D]``, k ``[B, S, Hkv, D]``."""
    hq = q.shape[2]
    k = k.float().repeat_interleave(hq // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bshd->bhqs", q.float(), k) * scale
    return scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1)


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """Prompts from a JSONL file (``prompt`` or ``text`` field per line) or a plain text file
    (prompts separated by blank lines)."""
    text = Path(path).read_text()
    if Path(path).suffix == ".jsonl":
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        prompts = [r.get("prompt", r.get("text")) if isinstance(r, dict) else r for r in rows]
        if any(not isinstance(p, str) for p in prompts):
            raise ValueError(f"{path}: every row needs a 'prompt' or 'text' string")
    else:
        prompts = [p for p in text.split("\n\n") if p.strip()]
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts[:limit] if limit else prompts


def measure_drift(
    target: Any,
    drafters: Sequence[Any],
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    spec: SpecConfig | None = None,
    max_new_tokens: int = 64,
    n_sink: int = 1,
    names: Sequence[str] | None = None,
    device: str = "cpu",
    **runtime_kw: Any,
) -> DriftReport:
    """Run greedy speculative decoding with each drafter over ``prompts`` and record drift curves.

    ``target``: a model directory or ``PreTrainedModel``; ``drafters``: directories or
    ``Eagle3Drafter`` objects; ``spec`` defaults to a chain of 6 (depth is unambiguous there).
    """
    from .drafter import Eagle3Drafter
    from .engine import SpeculativeRuntime
    from .target import TargetModel, resolve_layout

    spec = spec or SpecConfig.chain(6)
    if not isinstance(target, TargetModel):  # the layout the runtime's cpu_linear can run (as from_pretrained picks)
        lin = runtime_kw.get("cpu_linear", "auto")
        lay = "auto" if lin != "torch" else resolve_layout("auto", torch.device(device), None, "torch")
        tm = TargetModel.from_pretrained(target, device=device, weight_layout=lay)
    else:
        tm = target
    tokenizer = runtime_kw.pop("tokenizer", None)
    if tokenizer is None and isinstance(target, (str, Path)):
        from .weights import load_tokenizer

        tokenizer = load_tokenizer(Path(target))
    if any(isinstance(p, str) for p in prompts) and tokenizer is None:
        raise ValueError("string prompts need a tokenizer: pass a target directory that has one, or token ids")
    longest = max(len(tokenizer(p)["input_ids"]) if isinstance(p, str) else len(p) for p in prompts)
    runtime_kw.setdefault("max_seq_len", min(tm.max_position_embeddings, longest + max_new_tokens + 1))
    out = []
    for i, d in enumerate(drafters):
        name = names[i] if names else (str(d) if isinstance(d, (str, Path)) else f"drafter{i}")
        drafter = Eagle3Drafter.from_pretrained(d) if isinstance(d, (str, Path)) else d
        rt = SpeculativeRuntime(tm, drafter, tokenizer, spec=spec, max_batch_size=1, **runtime_kw)
        rec = DriftRecorder(spec.num_speculative_tokens, n_sink)
        drafts = accepted = 0
        per_pos = torch.zeros(spec.num_speculative_tokens)
        with rt.observe(rec):
            for p in prompts:
                s = rt.generate([p] if not isinstance(p, str) else p, max_new_tokens=max_new_tokens).stats
                drafts += s.num_drafts
                accepted += s.num_accepted_tokens
                per_pos += torch.tensor(s.accepted_per_position, dtype=torch.float32)
        c = rec.curves()
        out.append(
            DrifterCurves(
                name=name,
                fc_norm=drafter.config.fc_norm,
                norm_output=drafter.config.norm_output,
                attn_sink=c[:, 0].tolist(),
                attn_context=c[:, 1].tolist(),
                attn_drafted=c[:, 2].tolist(),
                carry_rms=c[:, 3].tolist(),
                acceptance=(per_pos / max(drafts, 1)).tolist(),
                mean_acceptance_length=1 + accepted / max(drafts, 1),
                samples=rec.counts.long().tolist(),
            )
        )
    return DriftReport(drafters=out, spec=asdict(spec), num_prompts=len(prompts), n_sink=n_sink)


def write_report(report: DriftReport, out_dir: str | Path) -> list[Path]:
    """``drift.json``, ``summary.txt`` and three PNG plots (needs matplotlib for the plots)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "drift.json", out / "summary.txt"]
    files[0].write_text(report.to_json())
    files[1].write_text(report.summary() + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        import warnings

        warnings.warn("matplotlib is not installed: no PNG plots (pip install 'tritonspec[plots]')", stacklevel=2)
        return files
    depth = lambda d: list(range(1, len(d.carry_rms) + 1))  # noqa: E731
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for d in report.drafters:
        axes[0].plot(depth(d), d.attn_drafted, marker="o", label=f"{d.name}: drafted")
        axes[0].plot(depth(d), d.attn_sink, marker="x", linestyle="--", label=f"{d.name}: sink")
    axes[0].set(title="attention share vs depth", xlabel="draft depth", ylabel="attention mass")
    axes[0].legend(fontsize=7)
    for d in report.drafters:
        axes[1].plot(depth(d), d.carry_rms, marker="o", label=d.name)
    axes[1].set(title="carried hidden state RMS vs depth", xlabel="draft depth", ylabel="RMS")
    axes[1].legend(fontsize=7)
    for d in report.drafters:
        axes[2].plot(depth(d), d.acceptance, marker="o", label=f"{d.name} (tau {d.mean_acceptance_length:.2f})")
    axes[2].set(title="acceptance vs depth", xlabel="draft depth", ylabel="rounds accepting depth k", ylim=(0, 1))
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    names = ["attention.png", "carry_norm.png", "acceptance.png"]
    for ax, name in zip(axes, names):  # one file per plot, plus the combined figure
        extent = ax.get_tightbbox(fig.canvas.get_renderer()).transformed(fig.dpi_scale_trans.inverted())
        fig.savefig(out / name, bbox_inches=extent.expanded(1.05, 1.1), dpi=110)
        files.append(out / name)
    fig.savefig(out / "drift.png", dpi=110)
    files.append(out / "drift.png")
    plt.close(fig)
    return files
