"""Tree-shape tuner: pick ``(num_speculative_tokens, top_k, num_draft_tokens)`` for this device.

``tune_tree`` runs the steps, each owned elsewhere:

1. plain decoding of the sample prompts: the baseline, and the target's greedy continuations
2. the cost model's round pieces, timed through the runtime's decoder (``tree_measure.measure_costs``)
3. the drafter's acceptance profile, by teacher forcing (``tree_measure.measure_acceptance``)
4. every shape ranked by predicted tokens/s (``tree_model.search``; the model is described there)
5. optionally, the chosen shape, two neighbours and the default ``SpecConfig()`` generated and
   compared with their predictions (``tree_measure.measure_generation``)
6. optionally, per batch size and sampling mode (``batch_sizes``, ``sampled``; batch 1 greedy
   included; always with ``compile``): the chosen shape, a few candidates around it (the rule of
   ``runtime/spec_policy.py`` at several row budgets, short chains; at batch 1 greedy also the
   shapes step 5 checked) and plain decoding generated side by side at that batch size; the
   fastest on decode is that row of the profile's ``shapes`` table (None: plain decoding wins, or that
   shape does not beat it end to end, the prompts' forward and the drafter's pass over them included,
   by ``PLAIN_MARGIN``, 8%). Without it,
   a chosen shape that measured slower than plain decoding gets a plain batch-1 row
7. optionally (``prompt_lookup``), each row's winning shape generated again side by side with a
   prompt-lookup branch of each given length (with each ``prompt_lookup_min``) grafted on
   (``runtime/ngram.py``; its gain depends on how much the outputs repeat the prompts, which no
   acceptance profile of the drafter predicts, so it is measured, never modelled); the fastest
   stays in the row (at batch 1, the shortest branch
   within 6% of the fastest is kept: ``LOOKUP_TIE``), unless plain decoding, measured again beside them, is
   faster still (then the row goes to plain decoding). A greedy row that plain
   decoding won tries the one-token chain with each lookup branch instead (kept only if faster)
8. optionally (``long_prompts``), the rows again on long prompts (batch 1, and every batch size
   and mode step 6 measured): the short prompts' winner at that batch, the same candidates as
   step 6 (at batch > 1 around the long batch-1 winner's row budget, or the cost model's pick's
   where plain decoding won the long batch-1 row) and plain decoding side by
   side (then step 7 on the winner). Every verified row attends over the whole context, so long
   prompts often want smaller trees. These rows carry ``"context": T``, T the geometric mean of
   the two prompt sets' median lengths: the runtime runs them for requests whose longest prompt
   has at least T tokens (``runtime/spec_policy.py``)
9. the profile written for the runtime to pick up (``runtime/profiles.write_profile``)

``compile=True`` (CPU) measures steps 5-6 with compiled rounds (``SpeculativeRuntime(compile=True)``;
each shape compiles once, untimed) and writes a ``rounds=compiled`` profile, which runtimes with
``compile=True`` read first. Compiled rounds shed the per-op overhead that eager rounds pay per
op, so their costs, and possibly their best shape, differ from eager rounds'; steps 2-4 (the cost
model) still time eager pieces, so only measured rows decide (they only seed the candidates).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..kernels import store
from ..runtime import profiles as prof
from ..runtime.config import DEFAULT_LOOKUP_MIN, SpecConfig
from ..runtime.spec_policy import rule_shape
from .tree_measure import Check, Measured, measure_acceptance, measure_costs, measure_generation
from .tree_model import TOP_KS, AcceptanceProfile, CostModel, Prediction, neighbours, predict, search


@dataclass
class TreeTuneResult:
    best: Prediction
    checks: list[Check]
    costs: CostModel
    acceptance: AcceptanceProfile
    plain: Measured
    n_roots: int
    profile_path: Path | None
    key: dict
    top: list[Prediction]
    shapes: list[dict] = field(default_factory=list)  # the profile's per-batch-size rows

    def table(self) -> str:
        rows = [
            (
                "shape (D, K, N)",
                "role",
                "pred tau",
                "meas tau",
                "pred ms/round",
                "meas ms/round",
                "pred speedup",
                "meas speedup",
                "end-to-end",
            )
        ]
        for c in self.checks:
            s = c.spec
            rows.append(
                (
                    f"({s.num_speculative_tokens}, {s.top_k}, {s.num_draft_tokens})",
                    c.role,
                    f"{c.predicted_tau:.2f}",
                    f"{c.measured_tau:.2f}",
                    f"{c.predicted_round_ms:.2f}",
                    f"{c.measured_round_ms:.2f}",
                    f"{c.predicted_speedup:.2f}x",
                    f"{c.measured_speedup:.2f}x",
                    f"{c.end_to_end_speedup:.2f}x",
                )
            )
        p = self.plain
        rows.append(
            (
                "plain decoding",
                "baseline",
                "1.00",
                "1.00",
                f"{self.costs.plain_token_s * 1e3:.2f}",
                f"{p.round_s * 1e3:.2f}",
                f"({p.decode_tokens_per_s:.1f} tok/s)",
                "1.00x",
                "1.00x",
            )
        )
        w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(x) for c, x in zip(r, w)).rstrip() for r in rows)


def tune_tree(
    target: Any,
    drafter: Any,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    backend: str = "auto",
    max_new_tokens: int = 64,
    max_depth: int = 8,
    top_ks: Sequence[int] = TOP_KS,
    max_draft_tokens: int = 64,
    stride: int = 1,
    reps: int = 7,
    out_dir: str | Path | None = None,
    dry_run: bool = False,
    validate: bool = True,
    batch_sizes: Sequence[int] = (1,),
    sampled: bool = False,
    temperature: float = 1.0,
    device_kind: bool = False,
    compile: bool = False,
    prompt_lookup: Sequence[int] = (),
    prompt_lookup_min: Sequence[int] = (),
    long_prompts: Sequence[str] | Sequence[Sequence[int]] = (),
    row_passes: int = 1,
    log=None,
) -> TreeTuneResult:
    """Measure costs and the acceptance profile, pick the best shape, check it, write the profile.

    ``target``/``drafter``: directories or loaded objects, as ``SpeculativeRuntime.from_pretrained``
    takes them. ``prompts``: strings (needs the target's tokenizer) or token id lists.
    ``validate``: generate with the chosen shape, two neighbours and the default ``SpecConfig()``
    and report measured against predicted speedups. ``batch_sizes`` / ``sampled``: also measure
    the best shape per batch size, greedy and (``sampled``) at ``temperature``, for the profile's
    ``shapes`` table. ``device_kind``: name the profile for this kind of device
    (``profiles.device_kind``: any CPU of the same architecture and vector ISA) instead of this
    exact one, as the profiles shipped with the package are. ``compile``: measure with compiled CPU
    rounds and write a ``rounds=compiled`` profile (module docstring). ``prompt_lookup``: lengths of
    a prompt-lookup branch to try on each row's winning shape (step 7; e.g. ``(4, 8)``);
    ``prompt_lookup_min``: the shortest suffixes to try each branch with (e.g. ``(1, 2)``; default
    ``SpecConfig``'s 2 alone).
    ``long_prompts``: prompts (strings or token ids) much longer than ``prompts``, for the
    long-context rows of step 8 (batch 1 or, as in step 6, every batch size; greedy and, with
    ``sampled``, sampled). ``row_passes``: interleaved passes over the prompts for each row's
    shapes (steps 6 and 8; the lookup passes of step 7 run ``max(2, row_passes)``), the order reversed
    every other pass and the rates summed over them: a pass's load swings reach 5-13 % on a shared
    machine, as large as many rows' margins.
    """
    from ..runtime.drafter import Eagle3Drafter
    from ..runtime.engine import SpeculativeRuntime
    from ..runtime.target import TargetModel
    from ..runtime.weights import load_tokenizer

    say = log or (lambda *_: None)
    tm = TargetModel.from_pretrained(target, device=device, dtype=dtype)
    # a directory: the runtimes' default drafter_weight_dtype="auto" applies, as in serving
    d = Eagle3Drafter.from_pretrained(drafter, loaded_by_runtime=True) if isinstance(drafter, (str, Path)) else drafter
    key = {"target": prof.target_fingerprint(tm), "drafter": prof.drafter_fingerprint(d)}
    tok = load_tokenizer(Path(target)) if isinstance(target, (str, Path)) else None
    top_ks = sorted(k for k in set(top_ks) if k <= d.config.draft_vocab_size)
    kmax, nmax = max(top_ks), max_draft_tokens
    lookups = sorted({int(m) for m in prompt_lookup} - {0})
    if any(m < 0 for m in lookups):
        raise ValueError(f"prompt_lookup={list(prompt_lookup)}: lengths must be >= 0")
    lookup_mins = sorted({int(j) for j in prompt_lookup_min}) or [DEFAULT_LOOKUP_MIN]
    if not all(1 <= j <= SpecConfig().prompt_lookup_max for j in lookup_mins):
        raise ValueError(
            f"prompt_lookup_min={list(prompt_lookup_min)}: each must be 1..{SpecConfig().prompt_lookup_max} "
            "(prompt_lookup_max)"
        )
    if any(isinstance(p, str) for p in [*prompts, *long_prompts]) and tok is None:
        raise ValueError("string prompts need the target's tokenizer; pass token id lists")
    ids = [list(tok(p, add_special_tokens=True)["input_ids"]) if isinstance(p, str) else list(p) for p in prompts]
    long_ids = [
        list(tok(p, add_special_tokens=True)["input_ids"]) if isinstance(p, str) else list(p) for p in long_prompts
    ]
    if row_passes < 1:
        raise ValueError(f"row_passes={row_passes} must be >= 1")
    threshold = _context_threshold(ids, long_ids) if long_ids else 0
    longest = max(len(p) for p in ids + long_ids)
    big = SpecConfig(
        max_depth,
        kmax,
        max(2, min(kmax + (max_depth - 1) * kmax * kmax + 1, nmax)),
        prompt_lookup_num_tokens=max(lookups, default=0),  # sizes the caches for every variant
    )
    rt = SpeculativeRuntime(
        tm,
        d,
        tok,
        backend=backend,
        spec=big,
        max_batch_size=max(batch_sizes),
        max_seq_len=min(longest + max_new_tokens + 2 * max_depth + 8, tm.max_position_embeddings),
        compile=True if compile else "auto",
    )
    if compile and not rt.compiled:
        raise ValueError("compile=True tunes compiled CPU rounds; this runtime's rounds are not compiled (a GPU?)")
    exact, kind = prof.device_names(rt.device, getattr(rt.target, "weight_layout", None))
    device = kind if device_kind else exact
    key.update(device=device, dtype=store.dtype_name(tm.dtype), backend=rt.backend)
    if compile:
        key["rounds"] = "compiled"
    say(
        f"[autotune tree] target={key['target']} drafter={key['drafter']} device={key['device']} "
        f"backend={rt.backend} rounds={key.get('rounds', 'eager')} prompts={len(ids)}"
    )

    measure_generation(rt, ids, max_new_tokens, [None])  # warm-up pass: first runs at each prompt length are slow
    plain = measure_generation(rt, ids, max_new_tokens, [None])[0]
    conts = plain.token_ids  # the target's greedy continuations (speculative output is identical)
    say(f"[autotune tree] plain decoding: {plain.decode_tokens_per_s:.1f} tokens/s; measuring costs ...")
    costs = measure_costs(rt, ids[0], max_depth=max_depth, top_ks=top_ks, max_n=nmax, reps=reps)
    # host work per round outside draft/verify/commit, read off plain decoding (the same for every shape)
    costs.overhead_s = max(plain.round_s - costs.plain_s, 0.0)
    say("[autotune tree] measuring the acceptance profile (teacher-forced drafts) ...")
    acc, n_roots = measure_acceptance(rt, ids, conts, max_depth=max_depth, max_rank=kmax, stride=stride)
    ranked = search(costs, acc, max_depth=max_depth, top_ks=top_ks, max_draft_tokens=nmax)
    best = ranked[0]
    checks: list[Check] = []
    if validate:
        default = SpecConfig()
        shapes = [(best.spec, "chosen")] + [(n.spec, "neighbour") for n in neighbours(best.spec, ranked)]
        fits = (
            default.num_speculative_tokens <= max_depth
            and default.top_k <= kmax
            and default.num_draft_tokens <= big.num_draft_tokens
        )
        if fits and all(s != default for s, _ in shapes):
            shapes.append((default, "default"))
        say(f"[autotune tree] checking {len(shapes)} shapes against plain decoding ...")
        plain, *ms = measure_generation(rt, ids, max_new_tokens, [None] + [spec for spec, _ in shapes])
        for (spec, role), m in zip(shapes, ms):
            pred = predict(spec, costs, acc)
            D, K, N = spec.num_speculative_tokens, spec.top_k, spec.num_draft_tokens
            psplit = {
                "draft": costs.draft(D, K),
                "verify": costs.verify(N),
                "commit": costs.commit(D),
                "other": costs.overhead_s,
            }
            msplit = {k: m.split_s.get(k, 0.0) / max(m.rounds, 1) for k in ("draft", "verify", "commit")}
            msplit["other"] = m.round_s - sum(msplit.values())
            checks.append(
                Check(
                    spec,
                    role,
                    pred.tokens_per_round,
                    m.tau,
                    pred.round_s * 1e3,
                    m.round_s * 1e3,
                    pred.speedup,
                    m.decode_tokens_per_s / plain.decode_tokens_per_s,
                    m.tokens_per_s / plain.tokens_per_s,
                    {k: round(v * 1e3, 3) for k, v in psplit.items()},
                    {k: round(v * 1e3, 3) for k, v in msplit.items()},
                )
            )
            say(
                f"[autotune tree] {role} {spec}: predicted {pred.speedup:.2f}x, "
                f"measured {checks[-1].measured_speedup:.2f}x"
            )
    shapes = []
    modes = [("greedy", 0.0)] + ([("sampled", temperature)] if sampled else [])
    sizes = sorted(set(batch_sizes) | {1}) if len(batch_sizes) > 1 or sampled or compile else []
    if sizes:  # every row measured, batch 1 greedy included
        for mode, temp in modes:
            for b in sizes:
                checked = [c.spec for c in checks] if (b, mode) == (1, "greedy") else []  # the check pass's shapes too
                shapes.append(
                    _best_at(rt, ids, max_new_tokens, b, mode, temp, best.spec, big, say, compile, checked, row_passes)
                )
    else:
        chosen = next((c for c in checks if c.role == "chosen"), None)
        if chosen is not None and chosen.measured_speedup < 1:  # measured slower than plain decoding at batch 1
            shapes.append({"batch_size": 1, "sampling": "greedy", "spec": None, "speedup": chosen.measured_speedup})
        elif lookups:  # the batch-1 greedy row, to carry the lookup's verdict
            shapes.append({"batch_size": 1, "sampling": "greedy", "spec": best.spec, "temperature": 0.0})
    for row in shapes if lookups else []:
        _lookup_at(rt, ids, max_new_tokens, row, lookups, say, lookup_mins, row_passes)
    if long_ids:  # step 8: the rows again on long prompts, for prompts of at least `threshold` tokens
        n = _median_len(long_ids)
        say(f"[autotune tree] long prompts ({len(long_ids)}, median {n} tokens): rows for prompts >= {threshold}")
        short_rows = {(r["batch_size"], r["sampling"]): r["spec"] for r in shapes}
        for mode, temp in modes:
            seed = best.spec  # the candidates' row budget: at batch > 1, the long batch-1 row's shape's
            for b in sizes or [1]:
                short_spec = short_rows.get((b, mode), best.spec if (b, mode) == (1, "greedy") else None)
                extra = [short_spec] if short_spec is not None else []
                row = _best_at(rt, long_ids, max_new_tokens, b, mode, temp, seed, big, say, compile, extra, row_passes)
                row.update(context=threshold, prompt_tokens=n)
                if lookups:
                    _lookup_at(rt, long_ids, max_new_tokens, row, lookups, say, lookup_mins, row_passes)
                if b == 1 and row["spec"] is not None:
                    seed = replace(row["spec"], prompt_lookup_num_tokens=0)
                shapes.append(row)
    path = None
    if not dry_run:
        path = _write_profile(
            out_dir, key, best, costs, acc, checks, plain, n_roots, max_new_tokens, shapes, row_passes
        )
    return TreeTuneResult(best, checks, costs, acc, plain, n_roots, path, key, ranked[:10], shapes)


def _median_len(ids: Sequence[Sequence[int]]) -> int:
    return sorted(len(p) for p in ids)[len(ids) // 2]


def _context_threshold(ids: Sequence[Sequence[int]], long_ids: Sequence[Sequence[int]]) -> int:
    """Prompt length from which the long-context rows apply: the geometric mean of the two sets'
    median lengths (the long set must be at least twice as long, or the rows say nothing new)."""
    short, long = _median_len(ids), _median_len(long_ids)
    if long < 2 * short:
        raise ValueError(
            f"long_prompts: their median length ({long} tokens) must be at least twice the prompts' ({short}); "
            "pass prompts of a few thousand tokens (e.g. a document followed by a question)"
        )
    return round((short * long) ** 0.5)


def candidates_at(
    batch_size: int,
    greedy: bool,
    chosen: SpecConfig,
    largest: SpecConfig,
    device_type: str = "cpu",
    compiled: bool = False,
) -> list[SpecConfig]:
    """Shapes worth measuring at ``batch_size``: the rule at row budgets around the batch-1 choice's
    (its ``num_draft_tokens``, half, double), short chains, and the batch-1 choice itself.
    ``compiled``: chains of 2, 4 and 6 instead of 1, 2 and 4 (a compiled drafter step costs far less
    than an eager one, so deeper chains may pay); sampled (``greedy=False``): a chain of 6 too (since the
    sampled chain's draws and race run natively, deeper sampled chains compete: demo pair, EAGLE-3.1,
    temperature 1, batch 1, one thread, 2026-12-07, 8 prompts x 4 passes: (3,1,4) 1.130x over plain decoding,
    (4,1,5) 1.144x, (5,1,6) 1.174x, (6,1,7) 1.147x)."""
    budget = chosen.num_draft_tokens
    shapes = [rule_shape(batch_size, greedy, r, device_type) for r in (budget, 2 * budget, budget // 2)]
    chains = (2, 4, 6) if compiled else (1, 2, 4) if greedy else (1, 2, 4, 6)
    shapes += [SpecConfig.chain(k) for k in chains] + ([chosen] if greedy else [])
    fits = [
        s
        for s in shapes
        if s is not None
        and s.num_speculative_tokens <= largest.num_speculative_tokens
        and s.top_k <= largest.top_k
        and s.num_draft_tokens <= largest.num_draft_tokens
    ]
    return list(dict.fromkeys(fits))  # distinct, in order


def _best_at(rt, ids, max_new_tokens, b, mode, temp, chosen, largest, say, compiled=False, extra=(), passes=1) -> dict:
    """The fastest of the candidate shapes (and ``extra`` ones) and plain decoding at batch size ``b``
    (a ``shapes`` row), measured over ``passes`` interleaved passes."""
    cands = candidates_at(b, mode == "greedy", chosen, largest, rt.device.type, compiled)
    cands += [s for s in extra if s not in cands]
    plain, *ms = measure_generation(
        rt, ids, max_new_tokens, [None, *cands], batch_size=b, temperature=temp, repeats=passes
    )
    rates = [m.decode_tokens_per_s for m in ms]
    i = max(range(len(cands)), key=rates.__getitem__)
    win = cands[i] if _beats_plain(ms[i], plain) else None
    say(
        f"[autotune tree] batch {b} {mode}: plain {plain.decode_tokens_per_s:.1f} tok/s, best "
        f"{cands[i].label} {rates[i]:.1f} tok/s (end to end {plain.tokens_per_s:.1f} / {ms[i].tokens_per_s:.1f}) "
        f"-> {win.label if win else 'plain decoding'}"
    )
    return {
        "batch_size": b,
        "sampling": mode,
        "spec": win,
        "temperature": temp,
        "decode_tokens_per_s": {
            "plain": round(plain.decode_tokens_per_s, 2),
            **{c.label: round(r, 2) for c, r in zip(cands, rates)},
        },
        "tokens_per_s": {  # end to end (the prompts' forward, and the drafter's pass over them, included)
            "plain": round(plain.tokens_per_s, 2),
            **{c.label: round(m.tokens_per_s, 2) for c, m in zip(cands, ms)},
        },
    }


# A speculative shape takes a row from plain decoding only when it measures this much faster: within
# it the two tie on the tuning prompts, and plain decoding has no acceptance to lose on other
# prompts (SmolLM2 EAGLE-3.1 at batch 4: (1,1,2) 99.0 vs plain 97.6 tokens/s on held-out prompts,
# where the same shape ran 0.85-0.90x of plain decoding on the benchmark's sets). 3% until 2026-12-07: the
# demo EAGLE-3.1 batch-4 long-context row took (3,1,4) at 1.036x (854 vs 824 tokens/s on 1,747-token
# prompts), which then ran 0.88-0.90x of plain decoding on the standard set's four longest prompts (one and
# two threads); and two plain measurements of one tuning pass differ by up to 13 % (the demo EAGLE-3 profile's
# batch-4 long row: 867 and 761 tokens/s), 2-5 % typically. The rates compared are end to end (the prompts'
# forward included), since 2026-12-07: only speculation pays the drafter's pass over the prompts, which at
# batch 4 on long prompts is as large as a modest decode gain (demo EAGLE-3.1, temperature 1, the long set:
# prefill 1,374 against 1,308 ms, 66 ms against 505 ms of plain decoding; the batch-4 long-context sampled row
# took (2,1,3) at 1.15x on decode rates and ran 0.84x of plain decoding end to end on the long set).
PLAIN_MARGIN = 0.08


def _beats_plain(m: Measured, plain: Measured, margin: float = PLAIN_MARGIN) -> bool:
    """Whether a shape takes a row from plain decoding: its end-to-end rate (prefill, and the drafter's pass over
    the prompts, included) above plain decoding's by more than ``margin``."""
    return m.tokens_per_s > (1 + margin) * plain.tokens_per_s


# At batch 1, the shortest lookup branch within this fraction of the fastest shape's rate is kept. Its cost is
# bounded where outputs do not quote the prompt (no match: its nodes are cut before the verify),
# its gain is large where they do, and no tuning set stands for every workload: SmolLM2 EAGLE-3.1
# (3,2,4) measured a tie with and without a 4-token branch on held-out recipe prompts, then 1.37x
# without and 1.93x with it on HumanEval (2026-12-03, 2 threads, AVX2). 3% until 2026-12-05: the same
# shape and branch, SmolLM2 EAGLE-3.1 (2,1,3) + lookup 4, measured 81.2 against 81.5 tokens/s without one
# day (kept) and 69.8 against 73.8 (-5.4%) the next (dropped) on the same tuning prompts, and dropping it
# cost HumanEval 1.67x -> 1.41x (τ 2.62 -> 1.77) while chat gained 1.21x -> 1.25x (Zen 4, 2 threads):
# a pass's load swings reach 5%, and the branch's loss where it does not pay stays that small.
LOOKUP_TIE = 0.06


def _lookup_at(
    rt,
    ids,
    max_new_tokens,
    row: dict,
    lookups: Sequence[int],
    say,
    mins: Sequence[int] = (DEFAULT_LOOKUP_MIN,),
    passes: int = 2,
) -> None:
    """Step 7 for one ``shapes`` row: plain decoding, its shape and the shape with each prompt-lookup
    length (each with every shortest suffix of ``mins``), side by side at the row's batch size and
    temperature (two passes, A B C then C B A); the fastest shape goes into the row (in place; at
    batch 1 the shortest lookup branch within ``LOOKUP_TIE`` of it, the faster of its ``mins``;
    plain decoding when it measures faster than every shape here), the
    rates into its ``lookup_decode_tokens_per_s``."""
    spec, b, temp = row["spec"], row["batch_size"], row.get("temperature", 0.0)
    sampled_chain = spec is not None and spec.top_k == 1 and spec.sample_chain_drafts and row["sampling"] == "sampled"
    if sampled_chain or (spec is None and row["sampling"] == "sampled"):  # verified against q: no lookup
        return
    if spec is None:  # plain decoding won: a lookup branch on the cheapest chain may still pay (quoting prompts)
        bare, cands = SpecConfig.chain(1), []
    else:  # the shape without a branch and with each (a winner that already has one is measured bare too)
        bare = replace(spec, prompt_lookup_num_tokens=0, prompt_lookup_min=DEFAULT_LOOKUP_MIN)
        cands = [bare]
    cands += [replace(bare, prompt_lookup_num_tokens=m, prompt_lookup_min=j) for m in lookups for j in mins]
    # twice, the order reversed on the second pass: a lookup branch's gain is often a few percent, the
    # size of a load swing during one pass
    plain, *ms = measure_generation(
        rt, ids, max_new_tokens, [None, *cands], batch_size=b, temperature=temp, repeats=max(2, passes)
    )
    rates = [m.decode_tokens_per_s for m in ms]
    i = max(range(len(cands)), key=rates.__getitem__)
    with_lookup = [j for j, c in enumerate(cands) if c.prompt_lookup_num_tokens]
    # a shape from the row pass (which beat plain decoding by PLAIN_MARGIN) must still beat it in this
    # pass's two runs; a greedy row plain decoding won needs the margin again (chain + branch)
    margin = 0.0 if spec is not None else PLAIN_MARGIN
    # a tie at batch 1 keeps a branch (LOOKUP_TIE): of the branches within it of the fastest shape that beat
    # plain decoding, the shortest. The lengths' rates differ by a load swing on the tuning prompts, and a
    # longer branch verifies more rows wherever it does not pay (SmolLM2 EAGLE-3 bfloat16 panels,
    # 2026-12-04: lookup 8 picked at 68.9 tok/s against lookup 4's 67.2, then on 6 HumanEval prompts 1.19x
    # against lookup 4's 1.32x over plain decoding)
    tied = [k for k in with_lookup if rates[k] >= (1 - LOOKUP_TIE) * rates[i] and _beats_plain(ms[k], plain, margin)]
    if b == 1 and tied:  # (of one length's suffix minimums the faster; on a tie, the default)
        i = min(
            tied,
            key=lambda k: (
                cands[k].prompt_lookup_num_tokens,
                -rates[k],
                cands[k].prompt_lookup_min != DEFAULT_LOOKUP_MIN,
            ),
        )
    win = cands[i] if _beats_plain(ms[i], plain, margin) else None
    row["spec"] = win
    row["lookup_decode_tokens_per_s"] = {"plain": round(plain.decode_tokens_per_s, 2)} | {
        c.label: round(r, 2) for c, r in zip(cands, rates)
    }
    say(
        f"[autotune tree] batch {b} {row['sampling']} prompt lookup: plain {plain.decode_tokens_per_s:.1f}, "
        + ", ".join(f"{c.label} {r:.1f} tok/s" for c, r in zip(cands, rates))
        + f" -> {win.label if win else 'plain decoding'}"
    )


def _write_profile(
    out_dir,
    key: dict,
    best: Prediction,
    costs: CostModel,
    acc: AcceptanceProfile,
    checks: list[Check],
    plain: Measured,
    n_roots: int,
    max_new_tokens: int,
    shapes: list[dict],
    row_passes: int = 1,
) -> Path:
    """The profile of ``best`` with the evidence behind it (``runtime/profiles.py`` owns the file)."""
    return prof.write_profile(
        out_dir,
        key,
        best.spec,
        predicted={"tokens_per_round": best.tokens_per_round, "round_s": best.round_s, "speedup": best.speedup},
        measured_with={
            "prompts": plain.n_prompts,
            "max_new_tokens": max_new_tokens,
            "acceptance_roots": n_roots,
            "plain_decode_tokens_per_s": plain.decode_tokens_per_s,
            "batch_size": 1,
            "row_passes": row_passes,
        },
        costs=asdict(costs),
        acceptance=asdict(acc),
        checks=[
            {**asdict(c), "spec": [c.spec.num_speculative_tokens, c.spec.top_k, c.spec.num_draft_tokens]}
            for c in checks
        ],
        shapes=shapes,
    )
