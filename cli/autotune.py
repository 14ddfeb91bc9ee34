"""``tritonspec autotune kernels|tree``: kernel launch configs (``autotune.kernel_tuner``) and the
draft-tree shape (``autotune.tree_tuner``) for this device, written to the per-device store."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..demo import tuning_prompts
from .common import add_command, is_demo, parse_dtype, resolve_pair

DEFAULT_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):",
    'def read_config(path):\n    """Read a JSON config file."""',
    "for i in range(10):",
    "The quick brown fox",
    "def quicksort(xs):",
    "with open(path) as f:",
]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``autotune`` subcommand (``kernels`` and ``tree``) to ``subparsers`` and return its parser."""
    a = add_command(
        subparsers,
        "autotune",
        "tune kernel launch configs and the draft-tree shape for this device",
        """examples:
  tritonspec autotune kernels                                    # Llama-3-8B shapes (+ the demo target), bf16
  tritonspec autotune kernels --shapes ./llama --dtype float16 --out ./tuned
  tritonspec autotune tree --target ./llama --drafter ./eagle3 --prompts prompts.jsonl
  tritonspec autotune tree --target demo --num-prompts 4 --dry-run
results go to $TRITONSPEC_TUNED_DIR or ~/.cache/tritonspec/tuned (override with --out); the kernel
launchers and SpeculativeRuntime(spec=None) read them from there.""",
    )
    sub = a.add_subparsers(dest="autotune_command", required=True)

    k = add_command(
        sub,
        "kernels",
        "search launch configs of the Triton kernels (needs a GPU)",
        """\
Each op is tuned per hidden size / head_dim (the reduction kernels: never per row count, so tuning
cannot break batch invariance); winners are merged into <op>,device_name=<GPU>,dtype=<dtype>.json.""",
    )
    k.add_argument(
        "--shapes",
        action="append",
        default=[],
        metavar="MODEL_DIR",
        help="HF model directory whose shapes to tune (repeatable; 'llama-3-8b' = the built-in "
        "Llama-3-8B shape; default: llama-3-8b and the demo target when bundled)",
    )
    k.add_argument("--dtype", default=None, help="bfloat16 (default on a GPU) | float16 | float32")
    k.add_argument(
        "--ops",
        default=None,
        help="comma-separated subset of rms_norm,aux_gather,tree_attention,verify_greedy,kv_compact",
    )
    k.add_argument("--device", default="cuda")
    _common(k)
    k.set_defaults(fn=cmd_kernels)

    t = add_command(
        sub,
        "tree",
        "pick (num_speculative_tokens, top_k, num_draft_tokens) for a target + drafter",
        """\
Measures the target's verify cost against tree size and the drafter's step cost on this device
and backend, and the drafter's acceptance per depth and sibling rank on the prompts (teacher-forced
along the target's greedy continuation); picks the shape with the best predicted tokens/s and
checks it, two neighbours and the default shape by generating (measured vs predicted speedup).""",
    )
    t.add_argument("--target", required=True, help="HF target directory, or 'demo' / 'demo:eagle3' (the bundled pair)")
    t.add_argument("--drafter", default=None, help="drafter directory (default with 'demo': its drafter)")
    t.add_argument(
        "--prompts",
        default=None,
        help='a .jsonl of {"prompt"|"text": ...} or {"messages": [...]} rows (chat, rendered by the target\'s '
        "template) or a text file (blank-line separated); default: the demo's tuning prompts for 'demo' "
        "(demo/prompts/tune.jsonl: files no benchmark prompt comes from), else a few built-in code prompts",
    )
    t.add_argument("--num-prompts", type=int, default=8, help="use the first N prompts (default 8)")
    t.add_argument(
        "--long-prompts",
        default=None,
        help="also tune the rows (batch 1, or each of --batch-sizes) on these long prompts (same formats as "
        "--prompts; a few thousand tokens each, e.g. a document and a question): the runtime runs them for "
        "requests whose longest prompt has at least the geometric "
        "mean of both sets' median lengths, where smaller trees often win; 'demo': the demo pair's long "
        "tuning prompts (demo/prompts/tune_long.jsonl)",
    )
    t.add_argument("--num-long-prompts", type=int, default=4, help="use the first N long prompts (default 4)")
    t.add_argument("--max-new-tokens", type=int, default=64)
    t.add_argument("--max-depth", type=int, default=8, help="deepest num_speculative_tokens searched (default 8)")
    t.add_argument("--top-k", default="1,2,4,8", help="top_k values searched (default 1,2,4,8)")
    t.add_argument("--max-draft-tokens", type=int, default=64, help="largest num_draft_tokens searched (default 64)")
    t.add_argument("--device", default="cpu")
    t.add_argument("--dtype", default=None)
    t.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    t.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads while measuring (default: torch's; 1 is steadiest on a busy machine)",
    )
    t.add_argument("--no-validate", action="store_true", help="skip the measured check of the chosen shape")
    t.add_argument(
        "--batch-sizes",
        default="1",
        help="also measure the best shape at these batch sizes, e.g. 1,2,4,8 (the profile's shapes table)",
    )
    t.add_argument("--sampled", action="store_true", help="also measure the best shapes for sampling (--temperature)")
    t.add_argument("--temperature", type=float, default=1.0, help="temperature of the sampled rows (default 1)")
    t.add_argument(
        "--device-kind",
        action="store_true",
        help="name the profile for this kind of device (e.g. cpu-x86_64-avx512) instead of this exact one",
    )
    t.add_argument(
        "--compile",
        action="store_true",
        help="CPU: measure compiled decode rounds (compile=True) and write a rounds=compiled profile, which "
        "runtimes with compile=True read first; each measured shape compiles once (about a minute each for "
        "the demo pair; pair with --no-validate)",
    )
    t.add_argument(
        "--prompt-lookup",
        default="",
        help="also try a prompt-lookup branch of these lengths on each winning shape, e.g. 4,8 (measured side "
        "by side; the fastest is kept; helps where outputs repeat the prompt, such as code)",
    )
    t.add_argument(
        "--prompt-lookup-min",
        default="",
        help="with --prompt-lookup: try each branch with these shortest matched suffixes, e.g. 1,2 "
        "(default 2 alone; 1 proposes more often)",
    )
    t.add_argument(
        "--row-passes",
        type=int,
        default=1,
        help="interleaved passes over the prompts for each batch-size row's shapes (default 1; 3 steadies the "
        "choice on a shared machine, about twice the tuning time)",
    )
    _common(t)
    t.set_defaults(fn=cmd_tree)
    return a


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out", default=None, help="output folder (default: $TRITONSPEC_TUNED_DIR or ~/.cache/tritonspec/tuned)"
    )
    p.add_argument("--dry-run", action="store_true", help="measure and print the winners; write nothing")


def cmd_kernels(args: argparse.Namespace) -> int:
    import os

    import torch

    from ..autotune import kernel_tuner as kt

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "kernel tuning needs a CUDA GPU (for a machinery check on the CPU, run with "
                "TRITON_INTERPRET=1 --device cpu and small --shapes; its timings mean nothing)"
            )
        dev = torch.device("cpu")
    dtype = parse_dtype(args.dtype) or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    shapes = [kt.LLAMA3_8B if s == "llama-3-8b" else kt.shape_from_model_dir(s) for s in args.shapes]
    if not shapes:
        shapes = [kt.LLAMA3_8B]
        from ..demo import available, demo_pair

        if available():
            shapes.append(kt.shape_from_model_dir(demo_pair("eagle3.1")[0]))
    ops = tuple(args.ops.split(",")) if args.ops else kt.OPS
    results, files = kt.tune_kernels(shapes, dtype, dev, ops=ops, out_dir=args.out, dry_run=args.dry_run)
    print(kt.format_results(results))
    for f in files:
        print(f"wrote {f}")
    if args.dry_run:
        print("dry run: nothing written")
    return 0


def read_tune_prompts(path: str, target: str | Path) -> list:
    """Prompts for the tree tuner: strings, or token ids for ``{"messages": [...]}`` JSONL rows (the
    target's chat template with the generation prompt, as ``generate`` renders chat)."""
    from ..runtime.drift import read_prompts

    if Path(path).suffix != ".jsonl":
        return read_prompts(path)
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not any(isinstance(r, dict) and "messages" in r for r in rows):
        return read_prompts(path)
    from ..runtime.requests import chat_ids
    from ..runtime.weights import load_tokenizer

    tok = load_tokenizer(Path(target))
    if tok is None:
        raise ValueError(f"{path}: chat rows need the target's tokenizer and chat template; {target} has none")
    out = []
    for i, r in enumerate(rows):
        if isinstance(r, dict) and "messages" in r:
            out.append(chat_ids(tok, r["messages"], f"{path}, row {i}"))
        elif isinstance(r, dict) and isinstance(r.get("prompt", r.get("text")), str):
            out.append(r.get("prompt", r.get("text")))
        else:
            raise ValueError(f"{path}, row {i}: needs a 'messages' list or a 'prompt'/'text' string")
    return out


def cmd_tree(args: argparse.Namespace) -> int:
    from ..autotune.tree_tuner import tune_tree

    demo = is_demo(args.target)
    if args.long_prompts == "demo" and not demo:
        raise ValueError("--long-prompts demo names the demo pair's long tuning prompts: use it with --target demo")
    target, drafter = resolve_pair(args.target, args.drafter)
    if drafter is None:
        raise ValueError("--drafter is required (a tree needs a drafter)")
    if args.prompts:
        prompts = read_tune_prompts(args.prompts, target)
    elif demo:
        prompts = [r["prompt"] for r in tuning_prompts("standard")]  # not the benchmark's rows
    else:
        prompts = DEFAULT_PROMPTS
    prompts = prompts[: args.num_prompts]
    if args.long_prompts == "demo":
        long_prompts = [r["prompt"] for r in tuning_prompts("long")]
    else:
        long_prompts = read_tune_prompts(args.long_prompts, target) if args.long_prompts else []
    long_prompts = long_prompts[: args.num_long_prompts]
    if not (Path(target) / "tokenizer.json").exists() and not (Path(target) / "tokenizer_config.json").exists():
        import torch

        vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab, (16,), generator=g).tolist() for _ in prompts]
        print("note: the target has no tokenizer; using random token prompts", file=sys.stderr)
    top_ks = [int(x) for x in args.top_k.split(",")]
    batch_sizes = sorted({int(x) for x in args.batch_sizes.split(",")} | {1})
    try:
        lookups = [int(x) for x in args.prompt_lookup.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-lookup {args.prompt_lookup!r}: give comma-separated lengths, e.g. 4,8") from None
    try:
        lookup_mins = [int(x) for x in args.prompt_lookup_min.split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"--prompt-lookup-min {args.prompt_lookup_min!r}: give comma-separated sizes, e.g. 1,2"
        ) from None
    if lookup_mins and not lookups:
        raise ValueError(f"--prompt-lookup-min {args.prompt_lookup_min}: needs --prompt-lookup (e.g. 4,8)")
    if batch_sizes[0] < 1:
        raise ValueError(f"--batch-sizes {args.batch_sizes}: batch sizes must be >= 1")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    res = tune_tree(
        target,
        drafter,
        prompts,
        device=args.device,
        dtype=parse_dtype(args.dtype),
        backend=args.backend,
        max_new_tokens=args.max_new_tokens,
        max_depth=args.max_depth,
        top_ks=top_ks,
        max_draft_tokens=args.max_draft_tokens,
        out_dir=args.out,
        dry_run=args.dry_run,
        validate=not args.no_validate,
        batch_sizes=batch_sizes,
        sampled=args.sampled,
        temperature=args.temperature,
        device_kind=args.device_kind,
        compile=args.compile,
        prompt_lookup=lookups,
        prompt_lookup_min=lookup_mins,
        long_prompts=long_prompts,
        row_passes=args.row_passes,
        log=lambda m: print(m, file=sys.stderr),
    )
    b = res.best
    s = b.spec
    print(
        f"chosen: num_speculative_tokens={s.num_speculative_tokens} top_k={s.top_k} "
        f"num_draft_tokens={s.num_draft_tokens} "
        f"(predicted tau {b.tokens_per_round:.2f}, {b.round_s * 1e3:.2f} ms/round, {b.speedup:.2f}x over plain)"
    )
    if b.speedup < 1:
        print(
            "note: every tree shape is predicted slower than plain decoding here (drafter too weak or too "
            "costly for this target on this device); generate with speculative=False"
        )
    if res.checks:
        print(res.table())
    for row in res.shapes:
        s = row["spec"]
        shape = "plain decoding" if s is None else s.label
        why = row.get("decode_tokens_per_s") or f"measured {row.get('speedup', 0):.2f}x at batch 1"
        where = f", prompts >= {row['context']} tokens" if row.get("context") else ""
        print(f"batch {row['batch_size']} {row['sampling']}{where}: {shape}  (decode tok/s: {why})")
    print(
        f"device={res.key['device']} backend={res.key['backend']} dtype={res.key['dtype']} "
        f"rounds={res.key.get('rounds', 'eager')} "
        f"acceptance roots={res.n_roots} prompts={len(prompts)}"
    )
    print(f"wrote {res.profile_path}" if res.profile_path else "dry run: nothing written")
    return 0
