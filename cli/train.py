"""``tritonspec train``: train an EAGLE-3 / EAGLE-3.1 drafter for a target through
``training.trainer`` (training-time test; resumes from ``<out>/checkpoint.pt``)."""

from __future__ import annotations

import argparse

from .common import add_command, flag_values

VARIANT_FLAGS = {"eagle3": False, "eagle3.1": True}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``train`` subcommand to ``subparsers`` and return its parser."""
    t = add_command(
        subparsers,
        "train",
        "train an EAGLE-3 / EAGLE-3.1 drafter for a target (training-time test)",
        """examples:
  tritonspec train --target ./llama --data code.jsonl --out ./my-eagle3.1
  tritonspec train --target ./llama --data ./src/ --variant eagle3 --ttt-depth 4 --steps 500 --out ./d3
  tritonspec train --target ./llama --data prompts.jsonl --regenerate 256 --out ./d   # self-distillation
data: a .jsonl file of {"text": ...} or {"input_ids": [...]} records, a text file, or a folder of *.py files.
A stopped run resumes from <out>/checkpoint.pt when rerun with the same settings.""",
    )
    t.add_argument("--target", required=True, help="HF target model directory")
    t.add_argument("--data", required=True, help="training data (see below)")
    t.add_argument("--out", required=True, help="output drafter directory")
    t.add_argument(
        "--variant",
        default="eagle3.1",
        choices=sorted(VARIANT_FLAGS),
        help="eagle3.1 = fc_norm + post-norm feedback (default); eagle3 = neither",
    )
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--batch-size", type=int, default=4)
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument(
        "--long-seq-len",
        type=int,
        default=0,
        help="also train on long contexts: sequences of more than half this many tokens are cut into windows of it, "
        "one window every --long-every-th step (0: off)",
    )
    t.add_argument("--long-every", type=int, default=4, help="every Nth step is a long one (with --long-seq-len)")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--ttt-depth", type=int, default=7, help="unrolled training-time-test steps (default 7)")
    t.add_argument("--draft-vocab-size", type=int, default=None, help="default: the full target vocabulary")
    t.add_argument(
        "--draft-vocab-file",
        default=None,
        metavar="FILE",
        help="a JSON list of the --draft-vocab-size target ids to draft (default: the data's most frequent ids, "
        "or with --init-from that drafter's vocabulary)",
    )
    t.add_argument(
        "--init-from",
        default=None,
        metavar="DIR",
        help="warm start from this drafter's weights and vocabulary (same variant and shapes; with "
        "--draft-vocab-file its vocabulary is replaced and the rows of shared ids carry over)",
    )
    t.add_argument("--aux-layer-ids", default=None, help="comma-separated boundary ids (default 2,N//2,N-3)")
    t.add_argument(
        "--regenerate",
        type=int,
        default=0,
        metavar="N",
        help="replace the data by N-token greedy continuations of the target (self-distillation)",
    )
    t.add_argument("--tokenizer", default=None, help="default: the tokenizer saved with the target")
    t.add_argument("--format", default="eagle3", choices=["eagle3", "speculators"])
    t.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    t.add_argument(
        "--autocast",
        default=None,
        choices=["bfloat16"],
        help="matmuls of the target and drafter forwards in bfloat16 (torch.autocast; weights stay float32); "
        "faster on CPUs with AMX and on GPUs",
    )
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="cpu")
    t.add_argument("--no-resume", action="store_true", help="ignore <out>/checkpoint.pt and start over")
    t.set_defaults(fn=cmd_train)
    return t


def cmd_train(args: argparse.Namespace) -> int:
    from ..training.trainer import TrainConfig, train_drafter

    flag = VARIANT_FLAGS[args.variant]
    ids = tuple(int(x) for x in args.aux_layer_ids.split(",")) if args.aux_layer_ids else None
    cfg = TrainConfig(
        **flag_values(args, "steps batch_size seq_len long_seq_len long_every lr ttt_depth"),
        **flag_values(args, "draft_vocab_size draft_vocab_file init_from seed device"),
        fc_norm=flag,
        norm_output=flag,
        aux_layer_ids=ids,
        regenerate_new_tokens=args.regenerate,
        save_format=args.format,
        save_dtype=args.dtype,
        autocast=args.autocast,
    )
    res = train_drafter(args.target, args.data, args.out, cfg, tokenizer=args.tokenizer, resume=not args.no_resume)
    acc = " ".join(f"{a:.2f}" for a in res.accuracies)
    print(
        f"[tritonspec] drafter={res.out_dir} variant={args.variant} steps={res.steps} "
        f"loss={res.final_loss:.3f} accuracy_per_depth={acc}"
    )
    return 0
