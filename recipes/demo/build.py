"""The demo recipe: rebuild the bundled demo pair (a small code LM and its EAGLE-3 / EAGLE-3.1 drafters).

Stages (each writes into ``--work`` and is skipped when its output exists, so a stopped run resumes):

1. ``corpus``    list the stdlib ``*.py`` files, hold out 5 % by path hash, train a byte-level BPE
                 tokenizer on the training files, tokenize them into one stream.
2. ``target``    pretrain a small Llama (``transformers.LlamaForCausalLM``) on that stream.
3. ``prompts``   write the evaluation prompt sets (``standard``, ``long``, ``perturbed``) from held-out files.
4. ``drafters``  regenerate continuations with the target (self-distillation data: after short prompts,
                 and after long ones that fill a long training window), then train an EAGLE-3 and an
                 EAGLE-3.1 drafter with the same data, seed and budget.
5. ``bundle``    copy the 16-bit weights, tokenizer, prompt sets and the manifest into ``--out``.

Examples
--------
    python -m tritonspec.recipes.demo --out demo/                   # full budget (~2.5 h, 2 CPU cores)
    python -m tritonspec.recipes.demo --out demo/ --budget bundled  # the bundled weights' budget
    python -m tritonspec.recipes.demo --out demo/ --budget quick    # the bundled weights' until 2026-12-07
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ...demo import VARIANTS as DEMO_VARIANTS
from ...training.trainer import warmup_cosine
from .corpus import EOS, list_corpus, read_text, stdlib_root, train_bpe_tokenizer

VARIANTS = tuple(DEMO_VARIANTS)  # the bundled drafters, as tritonspec.demo names them


@dataclass(frozen=True)
class RecipeConfig:
    """Every knob of the demo recipe (written to ``manifest.json`` next to the weights)."""

    seed: int = 0
    heldout_percent: int = 5
    vocab_size: int = 4096
    # target: a 12-layer Llama, narrow enough to train on a CPU, deep enough that one drafter
    # step costs <= 1/8 of a target step
    num_layers: int = 12
    hidden_size: int = 128
    intermediate_size: int = 384
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    target_steps: int = 1200  # ~40 min on 2 idle CPU cores (0.5 steps/s measured for this size)
    target_batch_tokens: int = 4096
    target_seq_len: int = 256
    target_long_seq_len: int = 2048  # the last target_long_frac of the steps, so long prompts are in range
    target_long_frac: float = 0.1
    target_lr: float = 2e-3
    # drafters
    draft_vocab_size: int = 2048
    regen_samples: int = 1024
    regen_prompt_tokens: int = 192
    regen_new_tokens: int = 128
    # long-context data: continuations after prompts of regen_long_prompt_tokens, trained on as windows
    # of drafter_long_seq_len every drafter_long_every-th step (0 samples: none), so the drafter meets the
    # positions of the standard (up to ~900 tokens) and long (1,500-1,800) prompts in training
    regen_long_samples: int = 768
    regen_long_prompt_tokens: int = 1912  # + regen_new_tokens = drafter_long_seq_len: one record a window
    drafter_steps: int = 3000
    drafter_seq_len: int = 320
    drafter_long_seq_len: int = 2040  # the target holds 2,048 positions; regeneration needs one more
    drafter_long_every: int = 4
    drafter_batch: int = 4
    drafter_lr: float = 1e-3
    ttt_depth: int = 7
    # prompt sets
    prompts_per_set: int = 100

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads and num_heads by num_kv_heads")
        if not 8 <= self.num_layers <= 12:
            raise ValueError(f"num_layers={self.num_layers}: the demo target has 8-12 layers")
        long_record = self.regen_long_prompt_tokens + self.regen_new_tokens
        if self.regen_long_samples and long_record <= self.drafter_long_seq_len // 2:
            raise ValueError(
                f"regen_long_prompt_tokens + regen_new_tokens = {long_record} "
                f"must exceed drafter_long_seq_len // 2 = {self.drafter_long_seq_len // 2}, or the long records are "
                "cut as short ones: raise regen_long_prompt_tokens or lower drafter_long_seq_len"
            )
        if not 50 <= self.prompts_per_set <= 200:
            raise ValueError(f"prompts_per_set={self.prompts_per_set} must lie in [50, 200]")


BUDGETS = {
    "full": RecipeConfig(),  # ~2.5 h on 2 CPU cores
    # the bundled weights since 2026-12-07: the quick budget's target; drafters on 8x the data and long windows
    # for 2,000 steps (the two drafters in parallel processes, one thread each: about 1 h)
    "bundled": RecipeConfig(target_steps=700, drafter_steps=2000),
    # the bundled weights until 2026-12-07, on 2 shared CPU cores, one thread per process (about 75 min)
    "quick": RecipeConfig(
        target_steps=700,
        regen_samples=1024,
        regen_long_samples=0,
        drafter_steps=1200,
        drafter_long_seq_len=0,
    ),
    # for tests of the recipe plumbing only (minutes; the models learn little)
    "smoke": RecipeConfig(
        num_layers=8,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=512,
        target_steps=4,
        target_batch_tokens=1024,
        target_seq_len=128,
        target_long_seq_len=256,
        regen_samples=4,
        regen_prompt_tokens=32,
        regen_new_tokens=16,
        regen_long_samples=2,
        regen_long_prompt_tokens=96,
        drafter_long_seq_len=128,
        drafter_steps=2,
        drafter_seq_len=64,
        drafter_batch=2,
        draft_vocab_size=256,
        prompts_per_set=50,
    ),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------------- 1. corpus
def stage_corpus(cfg: RecipeConfig, work: Path, root: Path) -> None:
    """Manifest of files, tokenizer, and the training token stream ``train_tokens.npy``."""
    if (work / "train_tokens.npy").exists():
        return
    files = list_corpus(root, cfg.heldout_percent)
    train = [f for f in files if not f.heldout]
    log(f"corpus: {len(files)} files ({len(files) - len(train)} held out) from {root}")
    texts = [read_text(root, f) for f in train]
    tok = train_bpe_tokenizer(texts, cfg.vocab_size, work / "tokenizer")
    eos = tok.convert_tokens_to_ids(EOS)
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    stream = np.fromiter((t for seq in ids for t in [*seq, eos]), dtype=np.uint16)
    (work / "corpus.json").write_text(
        json.dumps(
            {
                "root": str(root),
                "python": platform.python_version(),
                "heldout_rule": f"sha256(relpath) % 100 < {cfg.heldout_percent}",
                "excluded_dirs": "site-packages, test, tests, idle_test",
                "num_train_tokens": int(stream.size),
                "files": [asdict(f) for f in files],
            },
            indent=1,
        )
    )
    np.save(work / "train_tokens.npy", stream)
    log(f"corpus: {stream.size} training tokens, vocab {len(tok)}")


# ---------------------------------------------------------------------------------- 2. target
def target_config(cfg: RecipeConfig, tok) -> object:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
        architectures=["LlamaForCausalLM"],
    )


def sample_windows(stream: np.ndarray, batch: int, seq: int, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, stream.size - seq - 1, size=batch)
    return torch.from_numpy(np.stack([stream[s : s + seq].astype(np.int64) for s in starts]))


def stage_target(cfg: RecipeConfig, work: Path, device: torch.device) -> None:
    """Pretrain the target with AdamW; checkpoints every 100 steps, resumes from the last one."""
    out = work / "target"
    if (out / "config.json").exists():
        return
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(work / "tokenizer"))
    stream = np.load(work / "train_tokens.npy")
    seed_everything(cfg.seed)
    model = LlamaForCausalLM(target_config(cfg, tok)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.target_lr, betas=(0.9, 0.95), weight_decay=0.1)
    ckpt, start = work / "target_ckpt.pt", 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        log(f"target: resumed at step {start}")
    rng = np.random.default_rng([cfg.seed, start])
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target: {n_params / 1e6:.2f}M parameters, {cfg.target_steps} steps on {device}")
    long_from = int(cfg.target_steps * (1 - cfg.target_long_frac))
    t0, ema = time.time(), None
    model.train()
    for step in range(start, cfg.target_steps):
        seq = cfg.target_long_seq_len if step >= long_from else cfg.target_seq_len
        x = sample_windows(stream, max(1, cfg.target_batch_tokens // seq), seq + 1, rng).to(device)
        lr = warmup_cosine(step, cfg.target_steps, cfg.target_lr, warmup=min(100, cfg.target_steps // 10 + 1))
        loss = lm_step(model, opt, x, lr)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if (step + 1) % 20 == 0 or step + 1 == cfg.target_steps:
            rate = (step + 1 - start) / (time.time() - t0)
            log(
                f"target: step {step + 1}/{cfg.target_steps} loss {ema:.3f} seq {seq} "
                f"({rate:.2f} steps/s, eta {(cfg.target_steps - step - 1) / rate / 60:.1f} min)"
            )
        if (step + 1) % 100 == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, ckpt)
    model.eval()
    save_target(model.to(torch.float16), tok, out)
    log(f"target: saved to {out}")


def lm_loss(model, x: torch.Tensor) -> torch.Tensor:  # x: [B, T+1]
    logits = model(input_ids=x[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))


def lm_step(model, opt: torch.optim.Optimizer, x: torch.Tensor, lr: float) -> torch.Tensor:
    """One optimizer step at learning rate ``lr`` on the next-token loss over the windows ``x [B, T+1]``
    (gradients clipped to norm 1); returns the loss."""
    for g in opt.param_groups:
        g["lr"] = lr
    loss = lm_loss(model, x)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def save_target(model, tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.config.dtype = "float16"
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))


# ---------------------------------------------------------------------------------- 3. prompts
def stage_prompts(cfg: RecipeConfig, work: Path, root: Path) -> None:
    from .prompt_sets import write_prompt_sets

    if (work / "prompts" / "perturbed.jsonl").exists():
        return
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(work / "tokenizer"))
    files = [f for f in list_corpus(root, cfg.heldout_percent) if f.heldout]
    counts = write_prompt_sets(root, files, tok, work / "prompts", cfg.prompts_per_set, cfg.seed)
    log(f"prompts: {counts}")


# ---------------------------------------------------------------------------------- 4. drafters
def stage_drafters(cfg: RecipeConfig, work: Path, device: torch.device, variants: tuple[str, ...] = VARIANTS) -> None:
    from ...training import TrainConfig, train_drafter
    from ...training.data import regenerate_continuations

    regen = work / "regen.jsonl"
    stream = np.load(work / "train_tokens.npy")
    if not regen.exists():
        rng = np.random.default_rng([cfg.seed, 1])
        prompts = [w.tolist() for w in sample_windows(stream, cfg.regen_samples, cfg.regen_prompt_tokens, rng)]
        regenerate_continuations(work / "target", prompts, cfg.regen_new_tokens, regen, device=device, log=log)
    data: Path | list[list[int]] = regen  # the long records too: token-id lists of both files
    if cfg.regen_long_samples:
        regen_long = work / "regen_long.jsonl"
        if not regen_long.exists():
            rng = np.random.default_rng([cfg.seed, 3])
            n, p = cfg.regen_long_samples, cfg.regen_long_prompt_tokens
            prompts = [w.tolist() for w in sample_windows(stream, n, p, rng)]
            regenerate_continuations(work / "target", prompts, cfg.regen_new_tokens, regen_long, device=device, log=log)
        data = [json.loads(line)["input_ids"] for f in (regen, regen_long) for line in f.open()]
    for name in variants:
        flags = name == "eagle3.1"
        out = work / f"drafter-{name}"
        if (out / "config.json").exists():
            continue
        tc = TrainConfig(
            steps=cfg.drafter_steps,
            seq_len=cfg.drafter_seq_len,
            long_seq_len=cfg.drafter_long_seq_len if cfg.regen_long_samples else 0,
            long_every=cfg.drafter_long_every,
            batch_size=cfg.drafter_batch,
            lr=cfg.drafter_lr,
            ttt_depth=cfg.ttt_depth,
            draft_vocab_size=cfg.draft_vocab_size,
            fc_norm=flags,
            norm_output=flags,
            seed=cfg.seed,
            save_dtype="float16",
            checkpoint_every=50,
            device=str(device),
        )
        train_drafter(work / "target", data, out, tc, log=log)


# ---------------------------------------------------------------------------------- 5. bundle
def stage_bundle(cfg: RecipeConfig, work: Path, out: Path, budget: str, wall: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for sub in ("target", "drafter-eagle3", "drafter-eagle3.1", "prompts"):
        if (out / sub).exists():
            shutil.rmtree(out / sub)
        shutil.copytree(work / sub, out / sub, ignore=shutil.ignore_patterns("*.pt", "generation_config.json"))
    corpus = json.loads((work / "corpus.json").read_text())
    sizes = {p.relative_to(out).as_posix(): p.stat().st_size for p in sorted(out.rglob("*.safetensors"))}
    manifest = {
        "recipe": "python -m tritonspec.recipes.demo --budget " + budget,
        "budget": budget,
        "config": asdict(cfg),
        "torch": torch.__version__,
        "wall_time_s": wall,
        "weights_bytes": sizes,
        "corpus": corpus,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    total = sum(sizes.values())
    log(f"bundle: {out} ({total / 1e6:.1f} MB of weights)")
    if total > 40e6:
        raise RuntimeError(f"bundled weights are {total / 1e6:.1f} MB, above the 40 MB limit: shrink the target")


STAGES = ("corpus", "target", "prompts", "drafters", "bundle")


def _add_wall_time(path: Path, stage: str, seconds: float) -> None:
    """Add ``seconds`` to ``stage`` in the work folder's ``timings.json``. Read just
    before the write and replaced atomically: the two drafters' processes (``--variant``) share the file."""
    wall = json.loads(path.read_text()) if path.exists() else {}
    wall[stage] = wall.get(stage, 0.0) + seconds
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(wall, indent=1))
    tmp.replace(path)


def run(
    out: Path,
    work: Path,
    budget: str = "full",
    root: Path | None = None,
    until: str = "bundle",
    overrides: dict | None = None,
    variants: tuple[str, ...] = VARIANTS,
) -> Path:
    """Run the recipe stages up to ``until``; returns ``out``."""
    cfg = replace(BUDGETS[budget], **(overrides or {}))
    root = Path(root) if root is not None else stdlib_root()
    work.mkdir(parents=True, exist_ok=True)
    (work / "recipe_config.json").write_text(json.dumps({"budget": budget, **asdict(cfg)}, indent=1))
    device = pick_device()
    timings_path = work / "timings.json"
    for stage in STAGES[: STAGES.index(until) + 1]:
        t0 = time.time()
        if stage == "corpus":
            stage_corpus(cfg, work, root)
        elif stage == "target":
            stage_target(cfg, work, device)
        elif stage == "prompts":
            stage_prompts(cfg, work, root)
        elif stage == "drafters":
            stage_drafters(cfg, work, device, variants)
        else:
            wall = json.loads(timings_path.read_text()) if timings_path.exists() else {}
            stage_bundle(cfg, work, out, budget, wall)
        _add_wall_time(timings_path, stage, time.time() - t0)
    return out


def recipe_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The parser of a recipe command: its module docstring ``doc`` as the description, printed as written."""
    return argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def main(argv: list[str] | None = None) -> int:
    p = recipe_parser("python -m tritonspec.recipes.demo", __doc__)
    p.add_argument("--out", default="demo", help="where the bundle goes (the package's demo/ folder)")
    p.add_argument("--work", default=None, help="scratch folder for checkpoints (default: <out>/../.demo-work)")
    p.add_argument("--budget", default="full", choices=sorted(BUDGETS))
    p.add_argument("--until", default="bundle", choices=STAGES, help="stop after this stage")
    p.add_argument("--stdlib", default=None, help="corpus root (default: this Python's standard library)")
    p.add_argument(
        "--variant",
        default=None,
        choices=VARIANTS,
        help="train only this drafter (run the two in parallel once the first has written the data)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on shared cores 2 threads ran 20x slower, oversubscribed)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    work = Path(args.work) if args.work else out.resolve().parent / ".demo-work"
    run(out, work, args.budget, args.stdlib, args.until, variants=(args.variant,) if args.variant else VARIANTS)
    return 0
