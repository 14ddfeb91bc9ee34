"""``audit``: a rerunnable certificate that deterministic mode holds for a prompt set on this machine.

In deterministic mode (``runtime/deterministic.py``) a request's tokens and the logits each token
was chosen from are functions of (weights, prompt, seed) alone. The audit checks that claim:

* **identity.** Every prompt runs four ways: plain decoding alone (the reference), speculative
  alone, speculative in batches of ``batch_size``, plain in batches; greedy, and sampled at
  ``temperature`` with a seed per prompt. The emitted tokens and the target's logits of every
  emitted token (``EmissionRecorder``) must equal the reference's bit for bit.
* **sampling law.** Deterministic sampling draws the token at each position by an exponential race
  keyed on (seed, position), so for a fixed prompt the first tokens over many seeds must follow the
  target's processed softmax. For ``law_prompts`` prompts, ``law_samples`` seeds draw the first two
  tokens with speculation on (the second comes out of a verify round); a chi-square goodness-of-fit
  test compares the first token with the exact softmax at the prompt's end, and the second token,
  among the draws whose first token is the most frequent one, with the exact softmax after it.
  Bins with expected count below 5 are pooled; the test fails below ``p_threshold`` (1e-3), and at
  once if a token the processing removed (top-k/top-p) is drawn.

The report (``AuditReport``: Markdown and JSON) lists the sha256 of every file of the target and
drafter directories (weights, tokenizer, configs), the configs, package versions, device, threads,
settings, seeds, the probes' row counts and a verdict per prompt, with a sha256 of each prompt's
tokens and logits: rerun elsewhere, two reports compare line by line. ``report.ok`` is False on any
divergence (the CLI then exits 1).

Examples
--------
>>> report = audit(target_dir, drafter_dir, ["def fib(n):", "import os"], max_new_tokens=16)  # doctest: +SKIP
>>> report.ok, report.write("audit/")                                                      # doctest: +SKIP
(True, [PosixPath('audit/audit.md'), PosixPath('audit/audit.json')])
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..kernels.store import package_version
from .config import SpecConfig
from .deterministic import probe_table
from .errors import UserError
from .requests import encode_prompts
from .sampling import SamplingParams, process_logits

LAW_MIN_EXPECTED = 5.0  # chi-square bins hold at least this expected count (pooled below it)


# ================================================================== recording emitted logits
class EmissionRecorder:
    """An ``Ops`` proxy that keeps, per batch row, the target's logits of every emitted token.

    The head's ``linear`` over ``[B, H]`` is the prefill's choice of the first token (one emission
    per row); over ``[B, N, H]`` it is a verify forward, whose emitted tokens are chosen at the
    accepted nodes the next ``verify_*`` call returns. Rows keep what their round emitted even
    after they stop: read ``rows[b][:len(tokens)]``. Host reads per round: for audits and tests.
    """

    reads_host = True  # per-round host reads: the runtime runs rounds eagerly under this proxy

    def __init__(self, ops: Any, head: torch.Tensor):
        self.ops, self.head = ops, head
        self.rows: list[list[torch.Tensor]] = []
        self._pending: torch.Tensor | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ops, name)

    def linear(self, x, weight, bias=None):
        out = self.ops.linear(x, weight, bias)
        if weight is self.head:
            if x.dim() == 2:  # the prefill's last positions: the first emitted token of each row
                self.rows = [[r] for r in out.float().clone()]
            else:
                self._pending = out.float().clone()  # [B, N, V]
        return out

    def _accepted(self, result):
        nodes, num, _ = result
        if self._pending is not None:
            for b, (row, n) in enumerate(zip(nodes.tolist(), num.tolist())):
                self.rows[b].extend(self._pending[b, row[: n + 1]])
            self._pending = None
        return result

    def verify_greedy(self, *args, **kwargs):
        return self._accepted(self.ops.verify_greedy(*args, **kwargs))

    def verify_sampling(self, *args, **kwargs):
        return self._accepted(self.ops.verify_sampling(*args, **kwargs))

    def verify_chain(self, *args, **kwargs):
        return self._accepted(self.ops.verify_chain(*args, **kwargs))


def generate_recorded(rt, prompts, **kwargs) -> tuple[list[list[int]], list[torch.Tensor]]:
    """``rt.generate(prompts, **kwargs)`` and, per prompt, the target's logits ``[n, V]`` (float32) of
    each of its n emitted tokens (``EmissionRecorder`` on the runtime's decoder, removed after).

    The recorder reads the host every round, which no CUDA graph can capture: it says so
    (``reads_host``) and the runtime runs these rounds eagerly, trying no capture. Not thread-safe:
    it swaps the decoder's ops for the call (tests and audits)."""
    dec = rt.decoder
    # the recorder keeps logits per decoder row, which continuous batching would reuse: one static batch
    encode_prompts(
        prompts,
        rt.tokenizer,
        vocab_size=rt.target.vocab_size,
        max_seq_len=rt.max_seq_len,
        max_batch_size=rt.max_batch_size,
    )
    rec = EmissionRecorder(dec.ops, rt.target.lm_head)
    dec.ops = rec
    try:
        out = rt.generate(prompts, **kwargs)
    finally:
        dec.ops = rec.ops
    logits = [torch.stack(rec.rows[b][: len(t)]) for b, t in enumerate(out.token_ids)]
    return out.token_ids, logits


# ================================================================== chi-square
def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof): the regularized upper incomplete gamma Q(dof/2, x/2),
    by its series below a + 1 and Lentz's continued fraction above (Numerical Recipes §6.2), in
    float64 (scipy is not a dependency). ``chi2_sf(x, 2) == exp(-x/2)`` exactly in theory."""
    if dof < 1:
        raise ValueError(f"dof={dof} must be >= 1")
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    log_front = -z + a * math.log(z) - math.lgamma(a)
    if z < a + 1:  # P(a, z) by its series; Q = 1 - P
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1
            term *= z / ap
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = z + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-16:
            break
    return min(1.0, math.exp(log_front) * h)


@dataclass
class LawCheck:
    """A chi-square goodness-of-fit test of drawn tokens against the exact processed softmax."""

    prompt: int  # index in the prompt set
    token: str  # "first", or "second, first=<id>" (the second token given the most frequent first)
    samples: int
    bins: int
    chi2: float
    dof: int
    p_value: float
    impossible: int  # draws of tokens the processing removed (probability 0)
    ok: bool


def law_check(tokens: Sequence[int], probs: torch.Tensor, threshold: float, prompt: int, label: str) -> LawCheck:
    """Chi-square of ``tokens`` (draws) against ``probs [V]``: tokens with expected count >= 5 get a
    bin each, the rest one pooled bin (merged into the smallest bin if still below 5)."""
    n = len(tokens)
    counts = Counter(tokens)
    p = probs.double().cpu()
    impossible = sum(c for t, c in counts.items() if p[t] <= 0)
    expected = p * n
    order = torch.argsort(expected, descending=True).tolist()
    big = [t for t in order if expected[t] >= LAW_MIN_EXPECTED]
    bins = [(float(expected[t]), counts.get(t, 0)) for t in big]
    rest_e = float(expected.sum()) - sum(e for e, _ in bins)
    rest_o = n - sum(o for _, o in bins)
    if rest_e >= LAW_MIN_EXPECTED or not bins:
        bins.append((rest_e, rest_o))
    elif rest_e > 0 or rest_o > 0:
        e, o = bins.pop()
        bins.append((e + rest_e, o + rest_o))
    if len(bins) < 2:  # one bin: nothing to test beyond the impossible draws
        return LawCheck(prompt, label, n, len(bins), 0.0, 0, 1.0, impossible, impossible == 0)
    chi2 = sum((o - e) ** 2 / e for e, o in bins if e > 0)
    dof = len(bins) - 1
    pv = chi2_sf(chi2, dof)
    return LawCheck(prompt, label, n, len(bins), chi2, dof, pv, impossible, impossible == 0 and pv >= threshold)


# ================================================================== the report
@dataclass
class PromptVerdict:
    """One prompt in one sampling mode: each way of running it against plain decoding alone."""

    prompt: int  # index in the prompt set
    mode: str  # "greedy" or "sampled"
    seed: int | None
    prompt_tokens: int
    new_tokens: int
    tokens_sha256: str  # of the reference run's token ids ("1,2,3")
    logits_sha256: str  # of the reference run's emitted logits (float32, little-endian, row-major)
    checks: dict[str, bool]  # way -> identical tokens and logits
    first_divergence: dict | None  # {"way", "step", "what"} of the first failing way
    ok: bool


@dataclass
class AuditReport:
    ok: bool
    target: str
    drafter: str | None
    files: dict[str, dict[str, str]]  # "target"/"drafter" -> {relative path: sha256}
    configs: dict[str, Any]
    environment: dict[str, Any]
    settings: dict[str, Any]
    probes: list[dict]
    verdicts: list[PromptVerdict] = field(default_factory=list)
    laws: list[LawCheck] = field(default_factory=list)
    wall_time_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=False)

    def to_markdown(self) -> str:
        env, st = self.environment, self.settings
        bad = [v for v in self.verdicts if not v.ok]
        lines = [
            f"# tritonspec audit: {'PASS' if self.ok else 'FAIL'}",
            "",
            f"{len(self.verdicts)} prompt runs ({len(bad)} diverging), {len(self.laws)} sampling-law tests "
            f"({sum(not x.ok for x in self.laws)} failing), {self.wall_time_s:.1f} s.",
            "",
            f"- target: `{self.target}` ({len(self.files.get('target', {}))} files)",
            f"- drafter: `{self.drafter}` ({len(self.files.get('drafter', {}))} files)",
            f"- device: {env['device']} (capability {env.get('cpu_capability')}), "
            f"forward threads {env['forward_threads']}",
            f"- CPU kernels: {env.get('cpu_kernels')}",
            f"- versions: tritonspec {env['tritonspec']}, torch {env['torch']}, transformers {env['transformers']}, "
            f"triton {env['triton']}, python {env['python']}",
            "",
            "## Settings",
            "",
            "| setting | value |",
            "|---|---|",
            *[f"| {k} | `{json.dumps(v)}` |" for k, v in st.items()],
            "",
            "## Verdicts",
            "",
            "Each way must give the reference's tokens and emitted-token logits bit for bit "
            "(reference: plain decoding, one prompt at a time).",
            "",
            "| prompt | mode | seed | prompt tokens | new tokens | "
            + " | ".join(self.verdicts[0].checks if self.verdicts else [])
            + " | tokens sha256 | logits sha256 | verdict |",
            "|---|---|---|---|---|" + "---|" * len(self.verdicts[0].checks if self.verdicts else []) + "---|---|---|",
        ]
        for v in self.verdicts:
            checks = " | ".join("same" if ok else "**DIFFERS**" for ok in v.checks.values())
            why = "" if v.ok else f" ({v.first_divergence})"
            lines.append(
                f"| {v.prompt} | {v.mode} | {v.seed} | {v.prompt_tokens} | {v.new_tokens} | {checks} | "
                f"`{v.tokens_sha256[:16]}` | `{v.logits_sha256[:16]}` | {'ok' if v.ok else 'FAIL' + why} |"
            )
        lines += [
            "",
            "## Sampling law (chi-square, first tokens over seeds, speculation on)",
            "",
            "| prompt | token | samples | bins | chi2 | dof | p-value | impossible draws | verdict |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for x in self.laws:
            lines.append(
                f"| {x.prompt} | {x.token} | {x.samples} | {x.bins} | {x.chi2:.2f} | {x.dof} | {x.p_value:.4g} | "
                f"{x.impossible} | {'ok' if x.ok else 'FAIL'} |"
            )
        lines += ["", "## Probes (row counts from which each op is row-invariant here)", ""]
        lines.append(
            probe_table(_probe_objs(self.probes)) if self.probes else "(none: GPU kernels, invariant by design)"
        )
        lines += ["", "## Files", "", "| file | sha256 |", "|---|---|"]
        for which, files in self.files.items():
            lines += [f"| {which}/{name} | `{digest}` |" for name, digest in files.items()]
        lines += ["", "## Configs", "", "```json", json.dumps(self.configs, indent=1), "```", ""]
        return "\n".join(lines)

    def write(self, out_dir: str | Path) -> list[Path]:
        """Write ``audit.md`` and ``audit.json`` into ``out_dir`` (created); returns their paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        md, js = out / "audit.md", out / "audit.json"
        md.write_text(self.to_markdown())
        js.write_text(self.to_json())
        return [md, js]


def _probe_objs(rows: list[dict]):
    from .deterministic import Probe

    return [Probe(**{**r, "shape": tuple(r["shape"])}) for r in rows]


def file_hashes(directory: str | Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``directory`` (sorted, recursive)."""
    root = Path(directory)
    out = {}
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h = hashlib.sha256()
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        out[f.relative_to(root).as_posix()] = h.hexdigest()
    return out


def _configs(directory: Path) -> dict:
    return {
        f.name: json.loads(f.read_text())
        for f in sorted(directory.glob("*.json"))
        if f.name in ("config.json", "generation_config.json", "tokenizer_config.json")
    }


def _environment() -> dict:
    import transformers

    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": tv,
        "tritonspec": package_version(),
        "process_threads": torch.get_num_threads(),
        "forward_threads": 1,
        "cpu_kernels": _cpu_kernels(),
    }


def _cpu_kernels() -> dict:
    """The CPU kernels' instruction set and output digests (``kernels.cpu_linear.kernel_digest``):
    two reports whose digests match ran kernels that compute bit for bit alike, whatever the CPU."""
    from ..kernels import cpu_linear

    out: dict = {"isa": cpu_linear.isa()}
    for dt in (torch.float32, torch.bfloat16):
        try:
            out[f"digest_{str(dt).split('.')[-1]}"] = cpu_linear.kernel_digest(dt)
        except cpu_linear.CpuLinearUnavailable as e:
            out[f"digest_{str(dt).split('.')[-1]}"] = f"unavailable ({e})"
    return out


def _shape(choice) -> str:
    s = choice.spec
    where = f" ({choice.source})" if choice.source else ""
    return ("plain" if s is None else s.label) + where


def _digest_tokens(tokens: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()


def _digest_logits(logits: torch.Tensor) -> str:
    return hashlib.sha256(logits.float().contiguous().cpu().numpy().astype("<f4").tobytes()).hexdigest()


def _divergence(ref_t, ref_l, t, lg) -> str | None:
    """Where a run first departs from the reference (None: identical tokens and logits)."""
    if t != ref_t:
        k = next((i for i, (a, b) in enumerate(zip(t, ref_t)) if a != b), min(len(t), len(ref_t)))
        return f"token {k}: {t[k] if k < len(t) else None} instead of {ref_t[k] if k < len(ref_t) else None}"
    if lg.shape != ref_l.shape or not torch.equal(lg, ref_l):
        rows = [i for i in range(min(len(lg), len(ref_l))) if not torch.equal(lg[i], ref_l[i])] or [0]
        worst = float((lg[rows[0]] - ref_l[rows[0]]).abs().max()) if len(lg) and len(ref_l) else float("nan")
        return f"logits of token {rows[0]} differ (max |diff| {worst:.3g})"
    return None


# ================================================================== the audit
def _runs(rt, ids, seeds, batch_size: int, speculative: bool, kw: dict) -> list[tuple[list[int], torch.Tensor]]:
    """``(tokens, emitted logits)`` per prompt, generated in batches of ``batch_size`` (1: alone)."""
    out = []
    for i in range(0, len(ids), batch_size):
        s = seeds[i : i + batch_size] if seeds[0] is not None else None
        s = s[0] if s is not None and batch_size == 1 else s
        toks, logits = generate_recorded(rt, ids[i : i + batch_size], seed=s, speculative=speculative, **kw)
        out += list(zip(toks, logits))
    return out


def audit(
    target: str | Path,
    drafter: str | Path | None,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 32,
    batch_size: int = 4,
    spec: SpecConfig | None = None,
    temperature: float = 0.8,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    law_samples: int = 2000,
    law_prompts: int = 2,
    law_prompt_tokens: int = 32,
    p_threshold: float = 1e-3,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    backend: str = "auto",
    max_seq_len: int | None = None,
) -> AuditReport:
    """Run the audit (module docstring) on a target directory and a drafter directory; returns the
    report (``report.ok``; ``report.write(dir)``). ``temperature=0`` audits greedy decoding only;
    ``law_samples=0`` skips the sampling-law tests."""
    from .engine import SpeculativeRuntime

    t0 = time.perf_counter()
    tdir = Path(target)
    ddir = Path(drafter) if drafter is not None else None
    for what, d in (("target", tdir), ("drafter", ddir)):
        if d is not None and not d.is_dir():
            raise UserError(f"audit needs the {what} as a model directory (to hash its files), got {str(d)!r}")
    if not prompts:
        raise UserError("audit needs at least one prompt")
    if batch_size < 1 or max_new_tokens < 1:
        raise UserError(f"batch_size={batch_size} and max_new_tokens={max_new_tokens} must be >= 1")
    SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)  # validates
    law_batch = 16
    rt = SpeculativeRuntime.from_pretrained(
        tdir,
        ddir,
        device=device,
        dtype=dtype,
        backend=backend,
        spec=spec,
        max_batch_size=max(batch_size, law_batch if law_samples and temperature > 0 else 1),
        max_seq_len=max_seq_len,
        cuda_graphs=False,
        deterministic=True,
    )
    speculative = rt.drafter is not None
    if any(isinstance(p, str) for p in prompts) and rt.tokenizer is None:
        raise UserError("string prompts need a tokenizer in the target directory; pass token id lists")
    ids = [rt.tokenizer(p)["input_ids"] if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    keep = rt.max_seq_len - max_new_tokens  # a prompt longer than this keeps its last tokens (settings say so)
    if keep < 1:
        raise UserError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in max_seq_len={rt.max_seq_len}")
    truncated = sum(len(p) > keep for p in ids)
    ids = [p[-keep:] for p in ids]
    modes = [("greedy", 0.0)] + ([("sampled", temperature)] if temperature > 0 else [])
    verdicts = []
    for mode, temp in modes:
        kw = dict(max_new_tokens=max_new_tokens, temperature=temp, top_p=top_p, top_k=top_k, stop_token_ids=())
        seeds = [seed + i for i in range(len(ids))] if temp > 0 else [None] * len(ids)

        ref = _runs(rt, ids, seeds, 1, False, kw)
        ways = {"batched": _runs(rt, ids, seeds, batch_size, False, kw)}
        if speculative:
            ways = {
                "speculative": _runs(rt, ids, seeds, 1, True, kw),
                **ways,
                "speculative+batched": _runs(rt, ids, seeds, batch_size, True, kw),
            }
        for i, ((ref_t, ref_l), s) in enumerate(zip(ref, seeds)):
            checks, first = {}, None
            for name, runs in ways.items():
                why = _divergence(ref_t, ref_l, *runs[i])
                checks[name] = why is None
                if why is not None and first is None:
                    first = {"way": name, "what": why}
            verdicts.append(
                PromptVerdict(
                    i,
                    mode,
                    s,
                    len(ids[i]),
                    len(ref_t),
                    _digest_tokens(ref_t),
                    _digest_logits(ref_l),
                    checks,
                    first,
                    all(checks.values()),
                )
            )
    laws = []
    if law_samples > 0 and temperature > 0:
        sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        for i, p in enumerate(ids[:law_prompts]):
            p = p[:law_prompt_tokens]
            firsts, seconds, l1, l2 = [], [], None, {}
            for start in range(0, law_samples, law_batch):
                n = min(law_batch, law_samples - start)
                s = [10_000_000 + seed * 100_000 + i * 10_000 + start + j for j in range(n)]
                toks, logits = generate_recorded(
                    rt,
                    [p] * n,
                    max_new_tokens=2,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    seed=s,
                    stop_token_ids=(),
                    speculative=speculative,
                )
                for t, lg in zip(toks, logits):
                    firsts.append(t[0])
                    l1 = lg[0] if l1 is None else l1
                    if len(t) > 1:
                        seconds.append((t[0], t[1]))
                        l2.setdefault(t[0], lg[1])
            probs1 = process_logits(l1[None], sp).softmax(-1)[0]
            laws.append(law_check(firsts, probs1, p_threshold, i, "first"))
            mode_first = Counter(firsts).most_common(1)[0][0]
            given = [b for a, b in seconds if a == mode_first]
            if given:
                probs2 = process_logits(l2[mode_first][None], sp).softmax(-1)[0]
                laws.append(law_check(given, probs2, p_threshold, i, f"second, first={mode_first}"))
    settings = {
        "prompts": len(ids),
        "prompts_truncated": f"{truncated} prompt(s) cut to their last {keep} tokens" if truncated else 0,
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "speculative": speculative,
        "shapes": {
            f"batch {b} {mode}": _shape(rt.shape_policy.choose(b, mode == "greedy", max(map(len, ids))))
            for b in sorted({1, batch_size})
            for mode, _ in modes
        },
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seeds": f"prompt i: {seed} + i" if temperature > 0 else None,
        "law_samples": law_samples if temperature > 0 else 0,
        "law_prompts": min(law_prompts, len(ids)) if temperature > 0 and law_samples else 0,
        "law_prompt_tokens": law_prompt_tokens,
        "law_seeds": f"10_000_000 + {seed} * 100_000 + prompt * 10_000 + draw",
        "p_threshold": p_threshold,
        "device": str(rt.device),
        "dtype": str(rt.target.dtype).removeprefix("torch."),
        "backend": rt.backend,
        "max_seq_len": rt.max_seq_len,
        "prompt_sha256": [_digest_tokens(p) for p in ids],
    }
    files = {"target": file_hashes(tdir)}
    configs = {"target": _configs(tdir)}
    if ddir is not None:
        files["drafter"] = file_hashes(ddir)
        configs["drafter"] = _configs(ddir)
    ok = all(v.ok for v in verdicts) and all(x.ok for x in laws)
    return AuditReport(
        ok=ok,
        target=str(tdir),
        drafter=None if ddir is None else str(ddir),
        files=files,
        configs=configs,
        environment=_environment(),
        settings=settings,
        probes=[asdict(p) for p in rt.ops.probes],
        verdicts=verdicts,
        laws=laws,
        wall_time_s=time.perf_counter() - t0,
    )


__all__ = [
    "AuditReport",
    "EmissionRecorder",
    "LawCheck",
    "PromptVerdict",
    "audit",
    "chi2_sf",
    "file_hashes",
    "generate_recorded",
    "law_check",
]
