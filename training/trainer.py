"""Train an EAGLE-3 / EAGLE-3.1 drafter against a frozen target with the training-time test.

Online capture: every batch runs through tritonspec's own ``TargetModel`` (the forward that
serves), which yields the aux residual streams and the teacher logits, cut once a batch to what
the loss reads (``ttt.Teacher``: the argmax and the draft-vocabulary softmax); the drafter is unrolled
``ttt_depth`` steps with ``ttt.ttt_forward`` (the serving ``Eagle3Drafter.step``), and the
result is written by ``Eagle3Drafter.save_pretrained`` (the validated exporter).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ..kernels.cpu_linear import unpack
from ..runtime.drafter import Eagle3Drafter
from ..runtime.gguf import resolve_target
from ..runtime.metadata import AttentionMetadata
from ..runtime.ops import TorchOps
from ..runtime.target import TargetModel
from .data import (
    check_tokenizer,
    draft_vocab_from_counts,
    load_token_sequences,
    regenerate_continuations,
    token_windows,
)
from .ttt import Teacher, teacher_from_logits, ttt_forward

CHECKPOINT = "checkpoint.pt"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
AUTOCAST = (None, "bfloat16")  # TrainConfig.autocast


@dataclass(frozen=True)
class TrainConfig:
    """Drafter training settings.

    Parameters
    ----------
    steps, batch_size, seq_len : optimizer steps, windows per step, tokens per window.
    long_seq_len, long_every : > 0 trains on long contexts too: the sequences of more than
        ``long_seq_len // 2`` tokens are cut into windows of ``long_seq_len`` (the rest into ``seq_len``
        ones), and every ``long_every``-th step takes ``max(1, batch_size * seq_len // long_seq_len)``
        long windows instead of ``batch_size`` short ones. 0 (default): every window is ``seq_len``.
    lr, warmup_steps, grad_clip, weight_decay : AdamW(β=(0.9, 0.95)) with warm-up then cosine to 10 %.
    ttt_depth : unrolled training-time-test steps (EAGLE-3 uses 7; the 3.1 paper 4).
    fc_norm, norm_output : both True = EAGLE-3.1, both False = EAGLE-3.
    draft_vocab_size : None = the full target vocabulary; else the most frequent ids (d2t/t2d).
    aux_layer_ids : capture boundaries (0 = embeddings, N = last layer output); None = (2, N//2, N-3).
    regenerate_new_tokens : > 0 replaces the data by target continuations of this many tokens after
        prompts of ``regenerate_prompt_tokens`` cut from it (self-distillation; up to ``regenerate_samples``).
    init_lm_head_from_target : start the draft lm_head from the target's rows of the draft vocabulary
        (a warm start with ``draft_vocab_file`` always does so for the ids its drafter lacks).
    init_from : warm start: a drafter directory (``Eagle3Drafter.from_pretrained``) whose weights and
        draft vocabulary (d2t/t2d) the run starts from; it must match this run's variant and shapes.
    draft_vocab_file : a JSON list of the ``draft_vocab_size`` target ids the draft vocabulary covers
        (e.g. the most frequent tokens of the answers a drafter will predict) instead of the data's
        most frequent ids. With ``init_from`` it replaces the warm drafter's vocabulary: the lm_head
        rows of the ids both hold carry over, the others start from the target's rows, and the warm
        drafter's ``draft_vocab_size`` may differ from this run's.
    autocast : ``"bfloat16"`` runs the target's forward and the drafter's TTT forward under
        ``torch.autocast`` (matmuls in bfloat16, weights and optimizer state in float32; on a CPU with
        AMX a SmolLM2 step took 5.8 s instead of 8.5, one thread); None (default) = float32.

    Examples
    --------
    >>> TrainConfig(steps=10, ttt_depth=4).fc_norm
    True
    """

    steps: int = 1000
    batch_size: int = 4
    seq_len: int = 512
    long_seq_len: int = 0
    long_every: int = 4
    lr: float = 1e-3
    warmup_steps: int = 20
    grad_clip: float = 0.5
    weight_decay: float = 0.0
    ttt_depth: int = 7
    fc_norm: bool = True
    norm_output: bool = True
    draft_vocab_size: int | None = None
    aux_layer_ids: tuple[int, ...] | None = None
    intermediate_size: int | None = None
    init_lm_head_from_target: bool = True
    init_from: str | None = None
    draft_vocab_file: str | None = None
    regenerate_new_tokens: int = 0
    regenerate_prompt_tokens: int = 128
    regenerate_samples: int = 256
    seed: int = 0
    checkpoint_every: int = 100
    save_format: str = "eagle3"
    save_dtype: str = "float32"
    device: str = "cpu"
    autocast: str | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "ttt_depth", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.seq_len < 2:
            raise ValueError(f"seq_len={self.seq_len} must be >= 2")
        if self.long_seq_len and self.long_seq_len <= self.seq_len:
            raise ValueError(
                f"long_seq_len={self.long_seq_len} must exceed seq_len={self.seq_len} (or be 0: no long windows)"
            )
        if self.long_every < 2:
            raise ValueError(f"long_every={self.long_every} must be >= 2 (every long_every-th step is a long one)")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        if self.save_dtype not in DTYPES:
            raise ValueError(f"save_dtype={self.save_dtype!r}: use one of {sorted(DTYPES)}")
        if self.autocast not in AUTOCAST:
            raise ValueError(f"autocast={self.autocast!r}: use one of {AUTOCAST} (None = float32)")
        if self.save_format not in ("eagle3", "speculators"):
            raise ValueError(f"save_format={self.save_format!r}: use 'eagle3' or 'speculators'")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be >= 1")
        if self.draft_vocab_file is not None and self.draft_vocab_size is None:
            raise ValueError(
                f"draft_vocab_file={self.draft_vocab_file!r} needs draft_vocab_size (the number of ids it holds)"
            )


@dataclass
class TrainResult:
    """Where the drafter went and how training ended."""

    out_dir: Path
    steps: int
    final_loss: float
    accuracies: list[float]  # per TTT depth, averaged over the last steps
    history: list[dict]  # one record per step: loss, per-depth accuracy


# ---------------------------------------------------------------------------------- pieces
def warmup_cosine(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to 10 % of ``peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, frac))))


@torch.no_grad()
def capture(target: TargetModel, ops: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Aux states ``[B, T, n_aux*H_t]`` and logits ``[B, T, V]`` of the target over ``tokens [B, T]``."""
    B, T = tokens.shape
    positions = torch.arange(T, device=tokens.device).expand(B, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril().expand(B, T, T)
    zero = torch.zeros(B, dtype=torch.int64, device=tokens.device)
    hidden, aux = target.forward(ops, tokens, AttentionMetadata(positions, positions, zero, causal, T))
    return aux, target.logits(hidden)


def shared_teachers(
    logits: torch.Tensor,  # [B, T, V] target logits of a batch
    vocabularies: list[torch.Tensor],  # each [V_d] int64: a drafter's target_ids()
) -> list[Teacher]:
    """One ``Teacher`` per drafter, built once per distinct draft vocabulary (drafters trained side by
    side usually share theirs: the most frequent ids of the same data)."""
    built: list[Teacher] = []
    out = []
    for used in vocabularies:
        t = next((t for t in built if torch.equal(t.used, used)), None)
        if t is None:
            t = teacher_from_logits(logits, used)
            built.append(t)
        out.append(t)
    return out


def build_drafter(target: TargetModel, cfg: TrainConfig, seqs: list[list[int]]) -> Eagle3Drafter:
    """A fresh drafter for ``target`` with d2t/t2d from ``cfg.draft_vocab_file`` or else the token
    frequencies of ``seqs``, or, with ``cfg.init_from``, the weights and draft vocabulary of that
    drafter (a warm start; with ``draft_vocab_file`` the file's vocabulary, rows carried over)."""
    d = Eagle3Drafter.for_target(
        target.config,
        fc_norm=cfg.fc_norm,
        norm_output=cfg.norm_output,
        draft_vocab_size=cfg.draft_vocab_size,
        aux_layer_ids=cfg.aux_layer_ids,
        seed=cfg.seed,
        intermediate_size=cfg.intermediate_size,
    )
    c = d.config
    vocab = None if cfg.draft_vocab_file is None else read_draft_vocab(cfg.draft_vocab_file, c)
    if vocab is not None:
        d.set_draft_vocab(vocab)
    elif cfg.init_from is None and c.draft_vocab_size < c.vocab_size:
        d.set_draft_vocab(draft_vocab_from_counts(seqs, c.vocab_size, c.draft_vocab_size))
    if (cfg.init_from is None and cfg.init_lm_head_from_target) or (cfg.init_from is not None and vocab is not None):
        with torch.no_grad():  # a warm start's rows replace these where its vocabulary holds the id
            d.lm_head.weight.copy_(unpack(target.lm_head).float()[d.target_ids()])
    if cfg.init_from is not None:
        _warm_start(d, Path(cfg.init_from), keep_vocab=vocab is None)
    d.to(target.device)
    d.attach_target_embedding(target.embed.float(), target.drafter_info())
    return d


WARM_START_FIELDS = (
    "hidden_size",
    "vocab_size",
    "draft_vocab_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "aux_layer_ids",
    "fc_norm",
    "norm_output",
)


def read_draft_vocab(path: str | Path, config: Any) -> torch.Tensor:
    """The sorted target ids of a ``draft_vocab_file`` (a JSON list), checked against ``config``."""
    try:
        ids = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"draft_vocab_file={str(path)!r}: cannot read a JSON list of token ids there ({e})") from e
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"draft_vocab_file={str(path)!r} must hold a JSON list of integer target token ids")
    if len(set(ids)) != len(ids) or len(ids) != config.draft_vocab_size:
        raise ValueError(
            f"draft_vocab_file={str(path)!r} holds {len(set(ids))} distinct ids in {len(ids)} entries; "
            f"draft_vocab_size={config.draft_vocab_size} needs that many distinct ids"
        )
    if ids and not (0 <= min(ids) and max(ids) < config.vocab_size):
        raise ValueError(
            f"draft_vocab_file={str(path)!r} has ids outside the target vocabulary [0, {config.vocab_size})"
        )
    return torch.tensor(sorted(ids), dtype=torch.int64)


def _warm_start(d: Eagle3Drafter, src_dir: Path, keep_vocab: bool = True) -> None:
    """Copy the weights and draft vocabulary of the drafter at ``src_dir`` into the fresh ``d``; with
    ``keep_vocab=False``, ``d``'s own vocabulary stays and only the lm_head rows of the target ids
    both vocabularies hold are copied."""
    try:
        src = Eagle3Drafter.from_pretrained(src_dir)
    except (OSError, ValueError) as e:
        raise ValueError(f"init_from={str(src_dir)!r}: cannot load a drafter there ({e})") from e
    diff = [
        f"{k} {getattr(src.config, k)} (run: {getattr(d.config, k)})"
        for k in WARM_START_FIELDS
        if hasattr(d.config, k)
        and getattr(src.config, k) != getattr(d.config, k)
        and (keep_vocab or k != "draft_vocab_size")
    ]
    if diff:
        raise ValueError(
            f"init_from={str(src_dir)!r} does not match this run: {'; '.join(diff)}. Warm-start from a drafter "
            "of the same variant (fc_norm/norm_output) and shapes, or leave init_from unset"
        )
    state = {k: v.float() if v.is_floating_point() else v for k, v in src.state_dict().items()}
    if keep_vocab:
        d.load_state_dict({k: state[k] for k in d.state_dict()}, strict=True)
        return
    own = d.state_dict()  # d's vocabulary (d2t, t2d) and its lm_head rows from the target stay
    d.load_state_dict({k: own[k] if k in ("lm_head.weight", "d2t", "t2d") else state[k] for k in own}, strict=True)
    src_row = torch.full((src.config.vocab_size,), -1, dtype=torch.int64)
    src_row[src.target_ids()] = torch.arange(src.config.draft_vocab_size)
    rows = src_row[d.target_ids().to(src_row.device)]
    shared = rows >= 0
    with torch.no_grad():
        w = d.lm_head.weight
        w[shared.to(w.device)] = state["lm_head.weight"][rows[shared]].to(w.device, w.dtype)


def fingerprint(target: TargetModel, cfg: TrainConfig, windows: Windows) -> dict:
    """What a resumed run must share with the checkpoint it resumes from."""
    h = hashlib.sha256(windows.short.numpy().tobytes())
    if windows.long is not None:
        h.update(windows.long.numpy().tobytes())
    data_hash = h.hexdigest()[:16]
    keep = (
        "batch_size",
        "seq_len",
        "ttt_depth",
        "fc_norm",
        "norm_output",
        "draft_vocab_size",
        "aux_layer_ids",
        "intermediate_size",
        "init_from",
        "seed",
    ) + (("long_seq_len", "long_every") if cfg.long_seq_len else ())  # off: a checkpoint from before them resumes
    out = {
        "target": {"vocab_size": target.vocab_size, "hidden_size": target.hidden_size, "num_layers": target.num_layers},
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items() if k in keep},
        "data": data_hash,
    }
    if cfg.draft_vocab_file is not None:  # its ids, not its name or layout (a rerun may rewrite the file)
        ids = sorted(json.loads(Path(cfg.draft_vocab_file).read_text()))
        out["draft_vocab"] = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]
    return out


class Progress:
    """Training progress: a ``tqdm`` bar on a terminal; elsewhere (CI, a file, a ``log`` callback) the
    same line, logged at the first step, every ``every`` steps and at the last."""

    def __init__(self, total: int, start: int, log: Callable[[str], None], every: int = 10):
        self.total, self.start, self.log, self.every = total, start, log, every
        self.t0 = time.time()
        self.tty = sys.stderr.isatty() and log is print
        self.bar = tqdm(
            total=total, initial=start, desc="train", file=sys.stderr, dynamic_ncols=True, disable=not self.tty
        )

    def set_total(self, total: int) -> None:
        """A new step count (a time budget refitted it)."""
        self.total = self.bar.total = total

    def update(self, step: int, loss: float, accs: list[float]) -> None:
        done = step + 1
        postfix = f"loss {loss:.3f} acc@depth {' '.join(f'{a:.2f}' for a in accs)}"
        if self.tty:
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(1)
        elif done % self.every == 0 or done == self.total or done == self.start + 1:
            self.log(
                tqdm.format_meter(
                    done,
                    self.total,
                    time.time() - self.t0,
                    prefix="train",
                    ascii=True,
                    postfix=postfix,
                    initial=self.start,
                )
            )

    def close(self) -> None:
        self.bar.close()


# ---------------------------------------------------------------------------------- entry point
def train_drafter(
    target: str | Path | Any,
    data: Any,
    out: str | Path,
    config: TrainConfig | None = None,
    *,
    tokenizer: Any = None,
    resume: bool = True,
    time_budget_s: float | None = None,
    log: Callable[[str], None] = print,
) -> TrainResult:
    """Train a drafter for ``target`` on ``data`` and save it to ``out`` (``save_pretrained``).

    Parameters
    ----------
    target : HF model directory, a ``.gguf`` file, ``"smollm2"``, or a loaded transformers
        ``PreTrainedModel`` (frozen).
    data : JSONL (``text`` or ``input_ids`` records), a text file, a folder of ``*.py`` files, or a list
        of strings / token-id lists (see ``training.data``).
    out : output directory; ``out/checkpoint.pt`` is written every ``checkpoint_every`` steps and a
        later call with the same settings resumes from it.
    config : ``TrainConfig`` (defaults: EAGLE-3.1, TTT depth 7).
    time_budget_s : wall-clock budget: after the first steps, and again every 25, the step count is
        fitted to what the remaining time holds at the mean step time so far (the learning-rate
        schedule follows the new count); None = ``config.steps``.

    Examples
    --------
    >>> from tritonspec.training import TrainConfig, train_drafter
    >>> r = train_drafter("target_dir", "code.jsonl", "my-drafter",
    ...                   TrainConfig(steps=200, fc_norm=True, norm_output=True))   # doctest: +SKIP
    >>> r.accuracies                                                                # doctest: +SKIP
    """
    cfg = config or TrainConfig()
    runs = [(out, cfg)]
    kw = dict(tokenizer=tokenizer, resume=resume, time_budget_s=time_budget_s, log=log)
    return train_drafters(target, data, runs, **kw)[0]


# settings drafters trained together must share: they decide the data, the batches and the step count
SHARED = (
    "batch_size",
    "seq_len",
    "long_seq_len",
    "long_every",
    "seed",
    "draft_vocab_size",
    "aux_layer_ids",
    "device",
    "steps",
    "checkpoint_every",
    "regenerate_new_tokens",
    "regenerate_prompt_tokens",
    "regenerate_samples",
    "autocast",
)


@dataclass
class _Run:
    """One drafter being trained: its settings, module, optimizer and history."""

    out: Path
    cfg: TrainConfig
    drafter: Eagle3Drafter
    opt: Any
    params: list
    fp: dict
    history: list
    start: int  # the step a resumed checkpoint stopped at (0: a fresh run)


def train_drafters(
    target: str | Path | Any,
    data: Any,
    runs: list[tuple[str | Path, TrainConfig]],
    *,
    tokenizer: Any = None,
    resume: bool = True,
    time_budget_s: float | None = None,
    log: Callable[[str], None] = print,
) -> list[TrainResult]:
    """Train several drafters (e.g. EAGLE-3 and EAGLE-3.1) side by side on the same batches: the
    target's forward (aux states and teacher logits) is computed once per step and shared, so two
    drafters cost much less than two runs. ``runs``: ``(out, TrainConfig)`` pairs that agree on
    the data settings (batch, window, seed, draft vocabulary, aux layers, steps); the rest
    (variant, TTT depth, learning rate, ...) may differ. Otherwise as ``train_drafter``.
    """
    if not runs:
        raise ValueError("runs is empty: give at least one (out, TrainConfig) pair")
    cfg = runs[0][1]
    for _, c in runs[1:]:
        diff = [k for k in SHARED if getattr(c, k) != getattr(cfg, k)]
        if diff:
            raise ValueError(f"drafters trained together must share {', '.join(diff)}: train them separately")
    torch.manual_seed(cfg.seed)
    ops = TorchOps()
    target = resolve_target(target)
    tm = TargetModel.from_pretrained(target, device=cfg.device, dtype=torch.float32)
    tokenizer = _resolve_tokenizer(target, tokenizer, tm)
    seqs = load_token_sequences(data, tokenizer, tm.vocab_size)
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size > tm.vocab_size:
        raise ValueError(
            f"draft_vocab_size={cfg.draft_vocab_size} is larger than the target vocabulary "
            f"({tm.vocab_size}); use at most {tm.vocab_size}"
        )
    if cfg.regenerate_new_tokens > 0:
        Path(runs[0][0]).mkdir(parents=True, exist_ok=True)
        seqs = _self_distill(tm, seqs, cfg, Path(runs[0][0]), log)
    windows = Windows.cut(seqs, cfg)
    state = [_start_run(tm, Path(o), c, seqs, windows, resume, log) for o, c in runs]
    tm.set_aux_layer_ids(state[0].drafter.config.aux_layer_ids)
    tm.allocate_cache(*windows.largest(cfg))
    start = {r.start for r in state}
    if len(start) > 1:
        raise ValueError(
            f"the drafters' checkpoints stopped at different steps ({sorted(start)}): resume them separately "
            "or pass resume=False"
        )
    start = start.pop()
    total = cfg.steps
    bar = Progress(total, start, log)
    t0 = time.time()
    for r in state:
        r.drafter.train()
    step = start
    while step < total:
        batch = windows.batch(step, cfg).to(tm.device)
        with _autocast(cfg, tm.device):
            aux, logits = capture(tm, ops, batch)
        teachers = shared_teachers(logits, [r.drafter.target_ids() for r in state])
        del logits  # [B, T, V]: each drafter reads its teacher (argmax + draft-vocabulary softmax) instead
        for r, teacher in zip(state, teachers):
            with _autocast(cfg, tm.device):
                res = ttt_forward(r.drafter, ops, aux, batch, r.cfg.ttt_depth, teacher)
            for g in r.opt.param_groups:
                g["lr"] = warmup_cosine(step, total, r.cfg.lr, r.cfg.warmup_steps)
            r.opt.zero_grad(set_to_none=True)
            res.loss.backward()
            torch.nn.utils.clip_grad_norm_(r.params, r.cfg.grad_clip)
            r.opt.step()
            r.history.append({"step": step + 1, "loss": res.loss.item(), "acc": res.accuracies})
        r0 = state[0]
        bar.update(step, _mean_recent(r0.history, "loss"), _mean_recent_acc(r0.history))
        step += 1
        done = step - start
        if time_budget_s is not None and (done == BUDGET_PROBE_STEPS or done % BUDGET_REFIT_EVERY == 0):
            # fit the step count to the budget at the mean step time so far (refitted as the load changes)
            per_step = (time.time() - t0) / done
            fit = step + int((time_budget_s - (time.time() - t0)) / per_step)
            new_total = max(step, min(cfg.steps, fit))
            if new_total != total:
                total = new_total
                bar.set_total(total)
                log(f"train: {per_step:.1f} s a step; the time budget fits {total} steps (of {cfg.steps})")
        if step % cfg.checkpoint_every == 0 and step < total:
            for r in state:
                _save_checkpoint(r.out / CHECKPOINT, r.fp, r.drafter, r.opt, step, r.history)
    bar.close()
    return [_finish_run(r, data, total, log) for r in state]


def _autocast(cfg: TrainConfig, device: torch.device) -> Any:
    """``torch.autocast`` in ``cfg.autocast``'s dtype, or a no-op context (float32)."""
    if cfg.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[cfg.autocast])


BUDGET_PROBE_STEPS = 3  # steps timed before a time budget sets the step count
BUDGET_REFIT_EVERY = 25  # then refitted every this many steps (the machine's load changes)


def _start_run(
    tm: TargetModel,
    out: Path,
    cfg: TrainConfig,
    seqs: list[list[int]],
    windows: Windows,
    resume: bool,
    log: Callable[[str], None],
) -> _Run:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    drafter = build_drafter(tm, cfg, seqs)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    fp = fingerprint(tm, cfg, windows)
    start, history = _maybe_resume(out / CHECKPOINT, fp, drafter, opt, resume, log)
    log(
        f"train: {sum(p.numel() for p in params) / 1e6:.2f}M drafter parameters, {windows.describe(cfg)}, "
        f"TTT depth {cfg.ttt_depth}, fc_norm={cfg.fc_norm} norm_output={cfg.norm_output}, "
        f"draft vocab {drafter.config.draft_vocab_size}, steps {start}->{cfg.steps}"
    )
    return _Run(out, cfg, drafter, opt, params, fp, history, start)


def _finish_run(r: _Run, data: Any, steps: int, log: Callable[[str], None]) -> TrainResult:
    r.drafter.eval()
    r.drafter.save_pretrained(r.out, format=r.cfg.save_format, dtype=DTYPES[r.cfg.save_dtype])
    (r.out / "training_args.json").write_text(
        json.dumps(
            {
                "train_config": asdict(r.cfg),
                "steps_run": steps,
                "fingerprint": r.fp,
                "history": r.history,  # the loss curve: one record per step
                "data": str(data) if isinstance(data, (str, Path)) else f"<{type(data).__name__}>",
            },
            indent=1,
        )
    )
    (r.out / CHECKPOINT).unlink(missing_ok=True)
    accs = _mean_recent_acc(r.history)
    loss = _mean_recent(r.history, "loss")
    log(f"train: saved {r.out} (loss {loss:.3f}, accuracy per depth {' '.join(f'{a:.2f}' for a in accs)})")
    return TrainResult(r.out, steps, loss, accs, r.history)


def _resolve_tokenizer(target: Any, tokenizer: Any, tm: TargetModel) -> Any:
    from ..runtime.weights import load_tokenizer

    own = load_tokenizer(Path(target)) if isinstance(target, (str, Path)) else None
    if tokenizer is None:
        return own
    if isinstance(tokenizer, (str, Path)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    check_tokenizer(tokenizer, tm.config, own)
    return tokenizer


def _self_distill(
    tm: TargetModel, seqs: list[list[int]], cfg: TrainConfig, out: Path, log: Callable[[str], None]
) -> list[list[int]]:
    """Replace the data by prompts cut from it plus the target's own greedy continuations (generated
    by the already loaded ``tm``)."""
    n = cfg.regenerate_prompt_tokens
    prompts = [s[i : i + n] for s in seqs for i in range(0, max(1, len(s) - n + 1), n) if s[i : i + n]]
    g = torch.Generator().manual_seed(cfg.seed)
    order = torch.randperm(len(prompts), generator=g)[: cfg.regenerate_samples].tolist()
    path = regenerate_continuations(
        tm,
        [prompts[i] for i in order],
        cfg.regenerate_new_tokens,
        out / "regenerated.jsonl",
        device=cfg.device,
        log=log,
    )
    return load_token_sequences(path, None, tm.vocab_size)


def _batch(windows: torch.Tensor, index: int, batch_size: int, seed: int) -> torch.Tensor:
    """Batch ``index`` of ``windows``: a seeded permutation per epoch, so a resumed run sees the same batches."""
    n = windows.shape[0]
    picks = []
    for k in range(index * batch_size, (index + 1) * batch_size):
        epoch, i = divmod(k, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        picks.append(int(perm[i]))
    return windows[picks]


@dataclass
class Windows:
    """The training windows: ``short [N, seq_len]`` and, with ``long_seq_len``, ``long [N_l, long_seq_len]``
    cut from the sequences of more than ``long_seq_len // 2`` tokens (``TrainConfig``)."""

    short: torch.Tensor  # [N, seq_len] int64
    long: torch.Tensor | None  # [N_l, long_seq_len] int64, or None

    @classmethod
    def cut(cls, seqs: list[list[int]], cfg: TrainConfig) -> Windows:
        if not cfg.long_seq_len:
            short, long = token_windows(seqs, cfg.seq_len), None
        else:
            is_long = [len(s) > cfg.long_seq_len // 2 for s in seqs]
            n_long = sum(is_long)
            if n_long == 0 or n_long == len(seqs):
                fix = (
                    "add long-context records (e.g. the SmolLM2 recipe's --n-long) or set long_seq_len=0"
                    if n_long == 0
                    else "add short records, raise long_seq_len, or set long_seq_len=0"
                )
                raise ValueError(
                    f"long_seq_len={cfg.long_seq_len}: {n_long} of {len(seqs)} training sequences have more than "
                    f"{cfg.long_seq_len // 2} tokens; long windows need some long sequences and some short ones ({fix})"
                )
            short = token_windows([s for s, f in zip(seqs, is_long) if not f], cfg.seq_len)
            long = token_windows([s for s, f in zip(seqs, is_long) if f], cfg.long_seq_len)
        if short.shape[1] < 2:
            raise ValueError("training data has fewer than 2 tokens after tokenization: nothing to learn from")
        return cls(short, long)

    def is_long(self, step: int, cfg: TrainConfig) -> bool:
        return self.long is not None and (step + 1) % cfg.long_every == 0

    def batch(self, step: int, cfg: TrainConfig) -> torch.Tensor:
        """The windows of ``step``: ``[batch_size, seq_len]``, or on a long step ``[B_l, long_seq_len]``;
        the short and the long windows each go through their own seeded epochs."""
        if self.is_long(step, cfg):
            return _batch(self.long, step // cfg.long_every, long_batch_size(cfg), cfg.seed + 1)
        n_long = 0 if self.long is None else (step + 1) // cfg.long_every
        return _batch(self.short, step - n_long, cfg.batch_size, cfg.seed)

    def largest(self, cfg: TrainConfig) -> tuple[int, int]:
        """``(rows, tokens)`` the target's cache must hold for any step."""
        if self.long is None:
            return cfg.batch_size, self.short.shape[1]
        return max(cfg.batch_size, long_batch_size(cfg)), max(self.short.shape[1], self.long.shape[1])

    def describe(self, cfg: TrainConfig) -> str:
        s = f"{self.short.shape[0]} windows of {self.short.shape[1]} tokens"
        if self.long is not None:
            s += (
                f" and {self.long.shape[0]} of {self.long.shape[1]} (1 step in {cfg.long_every}, "
                f"{long_batch_size(cfg)} a step)"
            )
        return s


def long_batch_size(cfg: TrainConfig) -> int:
    """Windows in a long step: about the tokens of a short step, at least one."""
    return max(1, cfg.batch_size * cfg.seq_len // cfg.long_seq_len)


def _mean_recent(history: list[dict], key: str, n: int = 10) -> float:
    recent = history[-n:]
    return sum(h[key] for h in recent) / max(1, len(recent))


def _mean_recent_acc(history: list[dict], n: int = 10) -> list[float]:
    recent = [h["acc"] for h in history[-n:]]
    if not recent:
        return []
    return [sum(a[j] for a in recent) / len(recent) for j in range(len(recent[0]))]


def _save_checkpoint(path: Path, fp: dict, drafter: Eagle3Drafter, opt: Any, step: int, history: list) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {"fingerprint": fp, "drafter": drafter.state_dict(), "opt": opt.state_dict(), "step": step, "history": history},
        tmp,
    )
    tmp.replace(path)


def _maybe_resume(
    path: Path, fp: dict, drafter: Eagle3Drafter, opt: Any, resume: bool, log: Callable[[str], None]
) -> tuple[int, list]:
    if not resume or not path.exists():
        return 0, []
    try:
        state = torch.load(path, map_location=drafter.fc.weight.device, weights_only=False)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"cannot read checkpoint {path} ({e}); delete it or pass resume=False") from e
    if not isinstance(state, dict) or state.get("fingerprint") != fp:
        old = state.get("fingerprint") if isinstance(state, dict) else None
        diff = _diff(old, fp)
        raise ValueError(
            f"checkpoint {path} is incompatible with this run ({diff}); resume with the settings it "
            "was written with, or delete it / pass resume=False (--no-resume) to start over"
        )
    drafter.load_state_dict(state["drafter"])
    opt.load_state_dict(state["opt"])
    log(f"train: resumed from {path} at step {state['step']}")
    return int(state["step"]), list(state["history"])


def _diff(old: Any, new: dict) -> str:
    if not isinstance(old, dict):
        return "it is not a tritonspec training checkpoint"
    out = []
    for part in ("target", "config"):
        for k, v in new[part].items():
            if (old.get(part) or {}).get(k) != v:
                out.append(f"{k}: checkpoint {(old.get(part) or {}).get(k)!r}, now {v!r}")
    if old.get("data") != new["data"]:
        out.append("the training data differs")
    if old.get("draft_vocab") != new.get("draft_vocab"):
        out.append("the draft vocabulary (draft_vocab_file's ids) differs")
    return "; ".join(out) or "unknown difference"
