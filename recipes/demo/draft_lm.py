"""A 2-layer draft LM with the demo tokenizer, the draft model for transformers' assisted
generation in the performance reports (the baseline users would reach for).

Same data, tokenizer and optimiser as the demo target (``build``), 2 layers instead of 12:

    python -m tritonspec.recipes.demo.draft_lm --work /path/to/demo-work --out <package>/demo/draft-lm
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from ...training.trainer import warmup_cosine
from .build import lm_step, log, recipe_parser, sample_windows, save_target, seed_everything


def train_draft_lm(
    work: Path,
    out: Path,
    steps: int = 300,
    layers: int = 2,
    hidden: int = 128,
    seq: int = 256,
    batch_tokens: int = 4096,
    lr: float = 2e-3,
    seed: int = 0,
) -> Path:
    """Train a small ``LlamaForCausalLM`` on ``work/train_tokens.npy`` with ``work/tokenizer``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(work / "tokenizer"))
    stream = np.load(work / "train_tokens.npy")
    seed_everything(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng([seed, 7])
    t0 = time.time()
    model.train()
    for step in range(steps):
        x = sample_windows(stream, max(1, batch_tokens // seq), seq + 1, rng)
        loss = lm_step(model, opt, x, warmup_cosine(step, steps, lr, warmup=min(50, steps // 10 + 1)))
        if (step + 1) % 50 == 0 or step + 1 == steps:
            log(f"draft-lm: step {step + 1}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)")
    model.eval()
    save_target(model.to(torch.float16), tok, out)
    log(f"draft-lm: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters saved to {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = recipe_parser("python -m tritonspec.recipes.demo.draft_lm", __doc__)
    p.add_argument("--work", required=True, type=Path, help="the demo recipe's work folder (tokenizer, tokens)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=300)
    a = p.parse_args(argv)
    train_draft_lm(a.work, a.out, steps=a.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
