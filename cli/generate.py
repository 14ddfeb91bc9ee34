"""Command line: ``tritonspec <command>`` (also ``python -m tritonspec``)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

TINY = "tiny-random"
DEMO = "demo"  # the bundled demo pair (tritonspec.demo); "demo:eagle3" picks the EAGLE-3 drafter
_GRAPH_MODES = {"auto": "auto", "on": True, "off": False}  # --cuda-graphs -> SpeculativeRuntime(cuda_graphs=...)


def _spec_from_flags(depth: int | None, top_k: int | None, n: int | None):
    """None when no shape flag is given (a tuned profile, else the defaults); else the defaults with
    the given flags, a default ``num_draft_tokens`` capped at what the shape can draft (so
    ``--draft-top-k 1`` alone is a chain)."""
    from .runtime.config import SpecConfig

    if (depth, top_k, n) == (None, None, None):
        return None
    d = SpecConfig()
    depth, top_k = depth or d.num_speculative_tokens, top_k or d.top_k
    if n is None:
        n = min(d.num_draft_tokens, top_k + (depth - 1) * top_k * top_k + 1)
    return SpecConfig(depth, top_k, n)


def _cache_dir() -> Path:
    return Path(os.environ.get("TRITONSPEC_CACHE", Path.home() / ".cache" / "tritonspec"))


def _is_demo(target: str) -> bool:
    return target in (DEMO, f"{DEMO}:eagle3", f"{DEMO}:eagle3.1")


def _resolve_pair(target: str, drafter: str | None) -> tuple[str, str | None]:
    if _is_demo(target):
        from .demo import demo_pair

        tdir, ddir = demo_pair(target.partition(":")[2] or "eagle3.1")
        return str(tdir), (drafter or str(ddir))
    if target != TINY:
        return target, drafter
    from .runtime.tiny import tiny_random_pair

    tdir, ddir = tiny_random_pair(_cache_dir() / TINY)
    print(f"note: '{TINY}' is a random-weight Llama target and drafter ({tdir.parent}); the text is noise and "
          "the drafter is accepted only by chance", file=sys.stderr)
    return str(tdir), (drafter or str(ddir))


def _default_target() -> str:
    from .demo import available

    return DEMO if available() else TINY


def _dtype(name: str | None):
    import torch

    if name is None:
        return None
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise SystemExit(f"--dtype {name!r}: use one of {', '.join(table)}")
    return table[name]


def cmd_generate(args: argparse.Namespace) -> int:
    import tritonspec as ts

    prompt = args.prompt
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if not prompt:
        raise SystemExit("empty prompt: pass it as an argument or on stdin")
    target, drafter = _resolve_pair(args.target, args.drafter)
    spec = _spec_from_flags(args.num_speculative_tokens, args.draft_top_k, args.num_draft_tokens)
    rt = ts.SpeculativeRuntime.from_pretrained(
        target, drafter, device=args.device, dtype=_dtype(args.dtype), backend=args.backend, spec=spec,
        max_batch_size=1, max_seq_len=args.max_seq_len, cuda_graphs=_GRAPH_MODES[args.cuda_graphs])
    speculative = not args.no_speculative and rt.drafter is not None
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
              seed=args.seed, stop=args.stop or None, speculative=speculative)
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
    line = (f"[tritonspec] new_tokens={s.num_new_tokens} tokens/s={s.tokens_per_second:.1f} "
            f"mean_acceptance_length={s.mean_acceptance_length:.2f} "
            f"mode={'speculative' if speculative else 'plain'} backend={rt.backend} "
            f"cuda_graphs={'on' if rt._graphs is not None else 'off'}")
    if args.compare and speculative:
        base = rt.generate(prompt, **(kw | {"speculative": False}))
        line += (f" plain_tokens/s={base.stats.tokens_per_second:.1f} "
                 f"speedup={s.tokens_per_second / max(base.stats.tokens_per_second, 1e-9):.2f}x")
        if out_ids is not None and args.temperature == 0:
            line += f" identical={base.token_ids == out_ids}"
    print(line, file=sys.stderr if args.quiet_stats else sys.stdout)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import tritonspec as ts

    d = ts.Eagle3Drafter.from_pretrained(args.drafter, aux_layer_convention=args.aux_layer_convention)
    out = d.save_pretrained(args.out, format=args.format, dtype=_dtype(args.dtype))
    print(f"wrote {args.format} drafter to {out} (fc_norm={d.config.fc_norm}, norm_output={d.config.norm_output}, "
          f"aux_layer_ids={list(d.config.aux_layer_ids or [])})")
    return 0


def cmd_drift(args: argparse.Namespace) -> int:
    import tritonspec as ts
    from .runtime.drift import measure_drift, read_prompts, write_report

    target, drafters = args.target, list(args.drafter)
    if _is_demo(target):
        from .demo import demo_pair

        target = str(demo_pair("eagle3")[0])
        drafters = drafters or [str(demo_pair(v)[1]) for v in ("eagle3", "eagle3.1")]
    if not drafters:
        raise ValueError("pass at least one --drafter")
    prompts = read_prompts(args.prompts, args.num_prompts)
    report = measure_drift(target, drafters, prompts, spec=ts.SpecConfig.chain(args.depth),
                           max_new_tokens=args.max_new_tokens, n_sink=args.n_sink, device=args.device)
    files = write_report(report, args.out)
    print(report.summary())
    print(f"wrote {', '.join(f.name for f in files)} to {args.out}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .runtime.bench import SYSTEMS, Bench, format_table

    systems = args.systems.split(",")
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        raise ValueError(f"unknown systems {bad}; choose from {', '.join(SYSTEMS)}")
    if _is_demo(args.target):
        from . import demo

        target, d3 = demo.demo_pair("eagle3")
        drafters = {"eagle3": d3, "eagle3.1": demo.demo_pair("eagle3.1")[1]}
        draft_lm = demo.ROOT / "draft-lm"
        sets = {name: [r["prompt"] for r in demo.prompt_set(name)] for name in args.sets.split(",")}
    else:
        if not args.prompts:
            raise ValueError("--prompts FILE is needed with a --target other than the demo pair")
        from .runtime.drift import read_prompts

        target, draft_lm = args.target, args.draft_lm
        drafters = dict(d.split("=", 1) for d in args.drafter)
        sets = {Path(args.prompts).stem: read_prompts(args.prompts)}
    bench = Bench(target, drafters, draft_lm, max_seq_len=args.max_seq_len, device=args.device)
    results = []
    for name, prompts in sets.items():
        for system in systems:
            if bench.available(system, args.batch) is None:
                results.append(bench.run(system, prompts[: args.num_prompts], name, args.temperature, args.batch,
                                         args.max_new_tokens))
    print(format_table(results))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tritonspec", description="EAGLE-3/3.1 speculative decoding with Triton hot paths")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text (speculative by default) and print tokens/s and acceptance",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog="""examples:
  tritonspec generate "def fib(n):"                                 # tiny random pair (machinery check)
  tritonspec generate --target ./llama --drafter ./eagle3 "Hello" --compare
  echo "Hello" | tritonspec generate --target ./llama --no-speculative
  tritonspec generate "import os" --temperature 0.8 --top-p 0.95 --seed 1 --stop "\\n\\n" --stream""")
    g.add_argument("prompt", nargs="?", help="the prompt; '-' or nothing reads stdin")
    g.add_argument("--target", default=_default_target(),
                   help=f"HF target directory, '{DEMO}' / '{DEMO}:eagle3' (the bundled pair; default) or '{TINY}'")
    g.add_argument("--drafter", default=None, help="EAGLE-3/3.1 drafter directory (none: plain decoding)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="draft depth (default: the tuned profile for this pair and device, else 6)")
    g.add_argument("--draft-top-k", type=int, default=None, help="tree branching per level (default 8; 1 = chain)")
    g.add_argument("--num-draft-tokens", type=int, default=None,
                   help="tokens verified per round, root included (default 48)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples losslessly")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="sampling top-k (0 = off); the tree uses --draft-top-k")
    g.add_argument("--seed", type=int, default=None, help="sampling seed; the same seed gives the same output")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable); the text ends before it")
    g.add_argument("--stream", action="store_true", help="print text pieces as they are decided")
    g.add_argument("--no-speculative", action="store_true", help="plain target decoding through the same runtime")
    g.add_argument("--compare", action="store_true", help="also run plain decoding and print the speedup")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: float32 on CPU)")
    g.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--max-seq-len", type=int, default=None)
    g.add_argument("--cuda-graphs", default="auto", choices=list(_GRAPH_MODES),
                   help="capture decode rounds as CUDA graphs: auto (on a CUDA device), on, off (eager)")
    g.add_argument("--quiet-stats", action="store_true", help="print the stats line on stderr")
    g.set_defaults(fn=cmd_generate)

    e = sub.add_parser("export", help="re-save a drafter as LlamaForCausalLMEagle3 or speculators format",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog="""examples:
  tritonspec export --drafter ./yuhuili-eagle3 --out ./eagle3-sglang
  tritonspec export --drafter ./my-drafter --out ./my-drafter-spec --format speculators --dtype bfloat16""")
    e.add_argument("--drafter", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--format", default="eagle3", choices=["eagle3", "speculators"])
    e.add_argument("--dtype", default=None)
    e.add_argument("--aux-layer-convention", default="auto", choices=["auto", "boundary", "post_layer"])
    e.set_defaults(fn=cmd_export)

    b = sub.add_parser("bench", help="quick side-by-side throughput table (ours vs transformers), same prompts",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog="""examples:
  tritonspec bench                                   # demo pair, standard set, 4 prompts x 32 tokens, greedy
  tritonspec bench --sets standard,long,perturbed --systems ours-plain,ours-eagle3,ours-eagle3.1 --temperature 1
  tritonspec bench --target ./llama --drafter eagle3=./eagle3 --prompts p.jsonl
full reports: python -m pytest perf/bench_e2e.py --benchmark-json perf/e2e.json && python perf/report.py perf/e2e.json""")
    b.add_argument("--target", default=DEMO)
    b.add_argument("--drafter", action="append", default=[], help="NAME=DIR (repeatable), for a --target directory")
    b.add_argument("--draft-lm", default=None, help="draft LM directory for hf-assisted")
    b.add_argument("--prompts", default=None, help="prompt file for a --target directory")
    b.add_argument("--sets", default="standard", help="demo prompt sets, comma separated")
    b.add_argument("--systems", default="ours-plain,hf-greedy,ours-eagle3,ours-eagle3.1")
    b.add_argument("--num-prompts", type=int, default=4)
    b.add_argument("--max-new-tokens", type=int, default=32)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--batch", type=int, default=1)
    b.add_argument("--max-seq-len", type=int, default=None, help="default: the target's, at most 4096")
    b.add_argument("--device", default="cpu")
    b.set_defaults(fn=cmd_bench)

    dr = sub.add_parser("drift", help="measure attention drift per draft depth (EAGLE-3 vs 3.1), JSON + PNG plots",
                        formatter_class=argparse.RawDescriptionHelpFormatter, epilog="""examples:
  tritonspec drift --target ./llama --drafter ./eagle3 --drafter ./eagle3.1 --prompts prompts.jsonl --out drift/
  tritonspec drift --target demo --prompts demo/prompts/long.jsonl --num-prompts 20 --out drift-long/""")
    dr.add_argument("--target", required=True, help="HF target directory, or 'demo' (both demo drafters)")
    dr.add_argument("--drafter", action="append", default=[], help="drafter directory (repeatable)")
    dr.add_argument("--prompts", required=True, help="JSONL (prompt/text field) or text file (blank-line separated)")
    dr.add_argument("--out", required=True)
    dr.add_argument("--num-prompts", type=int, default=None)
    dr.add_argument("--max-new-tokens", type=int, default=64)
    dr.add_argument("--depth", type=int, default=6, help="chain depth measured (default 6)")
    dr.add_argument("--n-sink", type=int, default=1, help="leading slots counted as the attention sink")
    dr.add_argument("--device", default="cpu")
    dr.set_defaults(fn=cmd_drift)
    from .training.cli import add_parser as add_train_parser
    add_train_parser(sub)
    from .autotune.cli import add_parser as add_autotune_parser
    add_autotune_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError, KeyError, NotImplementedError, TypeError) as e:
        print(f"tritonspec {args.command}: error: {e}", file=sys.stderr)
        return 2
