"""End-to-end throughput of the systems users compare, measured side by side in one process.

Systems (same prompts, same process, same token budget; EOS is ignored so every system
generates exactly ``max_new_tokens`` per prompt):

    ours-plain         plain target decoding through our runtime (the speedup baseline)
    hf-greedy          transformers' ``generate`` (greedy or sampling), batched with left padding
    hf-prompt-lookup   transformers' prompt-lookup decoding (``prompt_lookup_num_tokens``), batch 1
    hf-assisted        transformers' assisted generation with a 2-layer draft LM, batch 1
    ours-eagle3        our runtime with the EAGLE-3 drafter
    ours-eagle3.1      our runtime with the EAGLE-3.1 drafter

One definition of every metric (ARCHITECTURE §5): tokens/s = new tokens / wall time (prefill
included); τ = 1 + accepted / drafts; ``accepted_per_position[i]`` / drafts = acceptance at depth
i+1; speedup = tokens/s ÷ ours-plain tokens/s for the same prompt set, temperature and batch.
transformers' prompt lookup and assisted generation run one prompt at a time (transformers
supports batch 1 only there), so at batch 4 they are reported as not applicable.
``Bench.run_interleaved`` measures several systems on the same chunks of prompts with the chunks
interleaved (chunk i runs every system in turn, the order rotated per chunk), so load swings on a
shared machine fall on all of them alike; ``Bench.run`` is that with one system.

Prompts are strings (tokenized once, without a chat template), token-id lists (e.g. a chat prompt
rendered by ``runtime/requests.py::chat_ids``) or chat conversations (rendered here the same way);
every system gets the same ids. Each result keeps the generated ids per prompt (``token_ids``) so a
benchmark can check that greedy outputs agree token for token (``first_difference``).
"""

from __future__ import annotations

import hashlib
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..kernels.store import package_version
from .config import SpecConfig
from .errors import UserError

SYSTEMS = ("ours-plain", "hf-greedy", "hf-prompt-lookup", "hf-assisted", "ours-eagle3", "ours-eagle3.1")
BATCH1_ONLY = {"hf-prompt-lookup", "hf-assisted"}


@dataclass
class BenchResult:
    system: str
    prompt_set: str
    temperature: float
    batch: int
    prompts: int
    new_tokens: int
    wall_time_s: float
    tau: float | None = None
    accepted_per_position: list[float] = field(default_factory=list)  # rate per depth
    note: str = ""
    compiled: bool = False  # our runtime with compiled rounds (compile time not in wall_time_s)
    compile_s: float = 0.0  # the untimed pass that compiled this configuration's rounds (and generated)
    shape_switches: int = 0  # adaptive shapes (runtime/adaptive.py): shape changes summed over the requests
    rounds_per_shape: dict[str, int] = field(default_factory=dict)  # rounds run with each shape, summed
    # passes > 1 (Bench.run_interleaved): each pass's wall time; wall_time_s is their median and the counts
    # above are the first pass's (every pass generates the same tokens: same prompts and seeds)
    pass_wall_s: list[float] = field(default_factory=list)
    same_tokens_every_pass: bool | None = None  # None with one pass
    # generated ids per prompt, in prompt order (not in ``info()``: its digests are, ``token_sha256``)
    token_ids: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def info(self) -> dict:
        d = asdict(self)
        d.pop("token_ids")
        return d | {"tokens_per_second": self.tokens_per_second, "token_sha256": self.token_digests()} | environment()

    def token_digests(self) -> list[str]:
        """sha256 hex digest of each prompt's generated ids (``token_ids``), a compact record of the output."""
        return [hashlib.sha256(",".join(map(str, t)).encode()).hexdigest() for t in self.token_ids]


def first_difference(a: list[list[int]], b: list[list[int]]) -> dict | None:
    """None when every prompt's ids agree, else where they first differ: ``{"prompt", "step", "a", "b"}``
    (``step`` counts generated tokens from 0; a token is None past the end of the shorter output)."""
    if len(a) != len(b):
        return {"prompt": min(len(a), len(b)), "step": 0, "a": None, "b": None, "prompts": [len(a), len(b)]}
    for i, (x, y) in enumerate(zip(a, b)):
        if x == y:
            continue
        k = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        return {"prompt": i, "step": k, "a": x[k] if k < len(x) else None, "b": y[k] if k < len(y) else None}
    return None


def environment() -> dict:
    import transformers

    dev = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"cpu ({platform.processor() or platform.machine()})"
    )
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    return {
        "device": dev,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": tv,
        "tritonspec": package_version(),
        "threads": torch.get_num_threads(),
    }


class Bench:
    """Loads each system once; ``run(system, prompts, ...)`` measures one configuration."""

    def __init__(
        self,
        target_dir: str | Path,
        drafters: dict[str, str | Path],
        draft_lm_dir: str | Path | None = None,
        spec: SpecConfig | None = None,
        max_seq_len: int | None = None,
        device: str = "cpu",
        assisted_unavailable: str | None = None,
        compile: bool | str = "auto",
    ):
        """``assisted_unavailable``: why hf-assisted cannot run when there is no draft LM (the text
        ``available`` returns), for pairs with no smaller model of the target's tokenizer.
        ``compile``: our runtimes' ``compile=`` (plain and speculative alike, so speedups stay fair)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .drafter import Eagle3Drafter
        from .engine import SpeculativeRuntime
        from .target import TargetModel

        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        tm = TargetModel.from_pretrained(target_dir, device=device)
        self.dtype = tm.dtype
        self._runtime_args = dict(spec=spec, max_batch_size=4, max_seq_len=max_seq_len, compile=compile)
        self._drafter_dirs = dict(drafters)
        self.runtimes = {"ours-plain": SpeculativeRuntime(tm, None, self.tokenizer, **self._runtime_args)}
        for name, d in drafters.items():
            self.runtimes[f"ours-{name}"] = SpeculativeRuntime(
                tm,
                Eagle3Drafter.from_pretrained(d, loaded_by_runtime=True),  # "auto" applies, as in serving
                self.tokenizer,
                **self._runtime_args,
            )
        self.compile = compile
        self.hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=self.dtype).to(device).eval()
        self.assisted_unavailable = assisted_unavailable
        self.draft_lm = None
        if draft_lm_dir is not None and (Path(draft_lm_dir) / "config.json").exists():
            self.draft_lm = AutoModelForCausalLM.from_pretrained(str(draft_lm_dir), dtype=self.dtype).to(device).eval()

    def add_fixed_shape(self, system: str) -> str:
        """Add ``<system>-fixed``: ``system``'s drafter (loaded again from its directory, as ``system``'s
        was) with ``adaptive_shape=False``, every request keeping the shape it starts with, on the
        same target; returns its name, a system ``run_interleaved`` accepts (adaptive vs fixed side
        by side, ``perf/bench_adaptive.py``)."""
        from .drafter import Eagle3Drafter
        from .engine import SpeculativeRuntime

        if system[len("ours-") :] not in self._drafter_dirs or system not in self.runtimes:
            raise UserError(
                f"add_fixed_shape takes one of our speculative systems "
                f"{[f'ours-{n}' for n in self._drafter_dirs]}, not {system!r}"
            )
        name = f"{system}-fixed"
        base = self.runtimes[system]
        d = Eagle3Drafter.from_pretrained(self._drafter_dirs[system[len("ours-") :]], loaded_by_runtime=True)
        self.runtimes[name] = SpeculativeRuntime(
            base.target, d, self.tokenizer, adaptive_shape=False, **self._runtime_args
        )
        return name

    def available(self, system: str, batch: int) -> str | None:
        """None when the system can run this configuration, else the reason it cannot."""
        if system in BATCH1_ONLY and batch != 1:
            return "transformers runs prompt lookup / assisted generation at batch 1 only"
        if system == "hf-assisted" and self.draft_lm is None:
            return self.assisted_unavailable or "no draft LM (build it with python -m tritonspec.recipes.demo.draft_lm)"
        if system.startswith("ours-") and system not in self.runtimes:
            return f"no {system[5:]} drafter"
        return None

    def run(
        self,
        system: str,
        prompts: Sequence[str | Sequence[int] | Sequence[dict]],
        prompt_set: str = "",
        temperature: float = 0.0,
        batch: int = 1,
        max_new_tokens: int = 64,
        seed: int = 0,
        passes: int = 1,
    ) -> BenchResult:
        """One system on ``prompts`` in chunks of ``batch`` (``run_interleaved`` with one system)."""
        return self.run_interleaved([system], prompts, prompt_set, temperature, batch, max_new_tokens, seed, passes)[
            system
        ]

    def run_interleaved(
        self,
        systems: Sequence[str],
        prompts: Sequence[str | Sequence[int] | Sequence[dict]],
        prompt_set: str = "",
        temperature: float = 0.0,
        batch: int = 1,
        max_new_tokens: int = 64,
        seed: int = 0,
        passes: int = 1,
    ) -> dict[str, BenchResult]:
        """Every system on the same chunks of ``batch`` prompts, interleaved: chunk ``i`` runs each
        system in turn (the order rotated by ``i``, so no system always runs right after another),
        each system's wall time summing its own chunks. Load swings on a shared machine then fall on
        all systems alike, which runs one after another do not (single runs here move 10-35%).

        ``passes``: the whole interleaved set that many times (the rotation shifted by the pass), each
        pass's wall time kept per system (``BenchResult.pass_wall_s``; ``wall_time_s`` is their median),
        so a speedup can be read per pass and its spread is the run's own noise (``perf/report.py``); the
        tokens and counts are the first pass's, and ``same_tokens_every_pass`` says whether every pass
        generated them again.

        Each system first gets one untimed call (a 2-token generation of the first chunk; with
        ``compile=True`` our runtimes get an untimed pass over every chunk, which compiles each key
        the timed pass meets: ``compile_s``). Chunk ``i`` samples with seed ``seed + i``.

        Examples
        --------
        >>> res = bench.run_interleaved(["ours-plain", "ours-eagle3.1"], prompts, "chat")  # doctest: +SKIP
        >>> res["ours-eagle3.1"].tokens_per_second / res["ours-plain"].tokens_per_second  # doctest: +SKIP
        """
        systems = list(dict.fromkeys(systems))
        if not systems:
            raise UserError("no systems to run: pass at least one of " + ", ".join(SYSTEMS))
        if not prompts:
            raise UserError("no prompts to run: pass at least one prompt")
        for name, v in (("batch", batch), ("max_new_tokens", max_new_tokens), ("passes", passes)):
            if v < 1:
                raise UserError(f"{name}={v} must be >= 1")
        for system in systems:
            if system not in SYSTEMS and system not in self.runtimes:  # or a variant added (add_fixed_shape)
                raise UserError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
            why = self.available(system, batch)
            if why:
                raise ValueError(f"{system} at batch {batch}: {why}")
        ids = [self.prompt_ids(p) for p in prompts]
        chunks = [ids[i : i + batch] for i in range(0, len(ids), batch)]
        runners = {
            s: (_OursRunner if s.startswith("ours-") else _HFRunner)(self, s, temperature, max_new_tokens, seed)
            for s in systems
        }
        for r in runners.values():
            r.warm(chunks)
        for p in range(passes):
            for i, c in enumerate(chunks):
                k = (i + p) % len(systems)
                for s in systems[k:] + systems[:k]:
                    runners[s].timed(i, c, p)
        return {s: r.result(prompt_set, temperature, batch, len(ids)) for s, r in runners.items()}

    def prompt_ids(self, prompt: str | Sequence[int] | Sequence[dict]) -> list[int]:
        """The ids every system gets for ``prompt``: a string tokenized as raw text, a token-id list as
        it is, a chat conversation rendered by the tokenizer's chat template."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            from .requests import chat_ids

            return chat_ids(self.tokenizer, items)
        if not items or not all(hasattr(t, "__index__") and not isinstance(t, bool) for t in items):
            raise UserError(
                f"a prompt is a string, a list of token ids or a chat conversation; got {type(prompt).__name__} "
                f"{str(prompt)[:60]}"
            )
        ids = [int(t) for t in items]
        vocab = self.hf.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise UserError(f"token id {bad} in a prompt lies outside the target's vocabulary [0, {vocab})")
        return ids


class _Runner:
    """One system's side of ``Bench.run_interleaved``: an untimed ``warm`` call, ``timed`` chunks
    (wall time summed, outputs and counts kept), then ``result``."""

    def __init__(self, bench: Bench, system: str, temperature: float, max_new_tokens: int, seed: int):
        self.bench, self.system = bench, system
        self.temperature, self.max_new_tokens, self.seed = temperature, max_new_tokens, seed
        self.compile_s = 0.0
        self.pass_wall: list[float] = []  # wall time per pass
        self.tokens = self.drafts = self.accepted = self.switches = 0
        self.shapes: dict[str, int] = {}
        self.outs: list[list[int]] = []
        self.chunk_outs: dict[int, list[list[int]]] = {}  # the first pass's tokens per chunk
        self.same = True  # every later pass generated the first pass's tokens
        self.per_pos = torch.zeros(0)  # grows to the deepest shape the requests ran (it may differ per chunk)

    @property
    def speculative(self) -> bool:
        """Our runtime with a drafter (ours-eagle*): the systems with τ and acceptance per depth."""
        return self.system.startswith("ours-eagle")

    def warm(self, chunks: list[list[list[int]]]) -> None:
        raise NotImplementedError

    def generate(self, i: int, chunk: list[list[int]], max_new_tokens: int, keep: bool = True) -> list[list[int]]:
        """Generate chunk ``i``; returns its token ids; ``keep``: count them (and the stats) in the result."""
        raise NotImplementedError

    def timed(self, i: int, chunk: list[list[int]], p: int = 0) -> None:
        """Chunk ``i`` of pass ``p``, timed; the first pass's tokens and counts are kept."""
        t0 = time.perf_counter()
        outs = self.generate(i, chunk, self.max_new_tokens, keep=p == 0)
        dt = time.perf_counter() - t0
        self.pass_wall += [0.0] * (p + 1 - len(self.pass_wall))
        self.pass_wall[p] += dt
        if p == 0:
            self.chunk_outs[i] = outs
        elif outs != self.chunk_outs.get(i):
            self.same = False

    @property
    def wall(self) -> float:
        """The median pass's wall time (the one pass's with one)."""
        return statistics.median(self.pass_wall) if self.pass_wall else 0.0

    def result(self, prompt_set: str, temperature: float, batch: int, prompts: int) -> BenchResult:
        spec = self.speculative
        return BenchResult(
            self.system,
            prompt_set,
            temperature,
            batch,
            prompts,
            self.tokens,
            self.wall,
            tau=(1 + self.accepted / self.drafts) if spec and self.drafts else None,
            accepted_per_position=(self.per_pos / max(self.drafts, 1)).tolist() if spec else [],
            compiled=self.system.startswith("ours-") and self.bench.compile is True,
            compile_s=self.compile_s,
            shape_switches=self.switches,
            rounds_per_shape=dict(self.shapes),
            pass_wall_s=list(self.pass_wall),
            same_tokens_every_pass=self.same if len(self.pass_wall) > 1 else None,
            token_ids=self.outs,
        )


class _OursRunner(_Runner):
    def warm(self, chunks):
        if self.bench.compile is True:  # an untimed pass first: it compiles every key the timed one meets
            t0 = time.perf_counter()  # (batch bucket x attention bound, which grows with the lengths)
            for i, c in enumerate(chunks):
                self.generate(i, c, self.max_new_tokens, keep=False)
            self.compile_s = time.perf_counter() - t0
        else:  # eager: one short untimed call, so first-call costs (buffers sized for this batch and
            # shape) stay out of the timing; they fell on whichever configuration a runtime met first
            self.generate(0, chunks[0], 2, keep=False)

    def generate(self, i, chunk, max_new_tokens, keep=True):
        out = self.bench.runtimes[self.system].generate(
            chunk,
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            seed=self.seed + i,
            stop_token_ids=[],
            speculative=self.speculative,
        )
        ids = [list(map(int, t)) for t in out.token_ids]
        if not keep:
            return ids
        s = out.stats
        self.outs += ids
        self.tokens += s.num_new_tokens
        self.drafts += s.num_drafts
        self.accepted += s.num_accepted_tokens
        self.switches += s.shape_switches
        for k, v in s.rounds_per_shape.items():
            self.shapes[k] = self.shapes.get(k, 0) + v
        if self.speculative:
            a = torch.tensor(s.accepted_per_position, dtype=torch.float32)
            self.per_pos = torch.nn.functional.pad(self.per_pos, (0, max(len(a) - len(self.per_pos), 0)))
            self.per_pos[: len(a)] += a
        return ids


class _HFRunner(_Runner):
    def __init__(self, *a):
        super().__init__(*a)
        tok = self.bench.tokenizer
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        kw: dict[str, Any] = dict(pad_token_id=self.pad, eos_token_id=None)
        if self.temperature > 0:
            kw.update(do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0)
        else:
            kw.update(do_sample=False)
        if self.system == "hf-prompt-lookup":
            kw["prompt_lookup_num_tokens"] = 10
        if self.system == "hf-assisted":
            kw["assistant_model"] = self.bench.draft_lm
        self.kw = kw

    def warm(self, chunks):  # one short untimed call, as for our runtimes
        self.generate(0, chunks[0], 2, keep=False)

    @torch.inference_mode()
    def generate(self, i, chunk, max_new_tokens, keep=True):
        dev = self.bench.device
        torch.manual_seed(self.seed + i)
        width = max(len(x) for x in chunk)  # left padding
        input_ids = torch.tensor([[self.pad] * (width - len(x)) + x for x in chunk], device=dev)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in chunk], device=dev)
        out = self.bench.hf.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            **self.kw,
        )
        ids = out[:, width:].tolist()
        if keep:
            self.tokens += (out.shape[1] - width) * len(chunk)
            self.outs += ids
        return ids


def format_table(results: list[BenchResult]) -> str:
    """A plain-text table with speedups against ours-plain of the same set/temperature/batch."""
    base = {(r.prompt_set, r.temperature, r.batch): r.tokens_per_second for r in results if r.system == "ours-plain"}
    lines = [f"{'set':<10} {'T':>3} {'B':>2} {'system':<17} {'tok/s':>8} {'speedup':>8} {'tau':>5}  accept/depth"]
    for r in results:
        b = base.get((r.prompt_set, r.temperature, r.batch))
        sp = f"{r.tokens_per_second / b:.2f}x" if b else "-"
        tau = f"{r.tau:.2f}" if r.tau is not None else "-"
        acc = " ".join(f"{a:.2f}" for a in r.accepted_per_position)
        lines.append(
            f"{r.prompt_set:<10} {r.temperature:>3g} {r.batch:>2} {r.system:<17} {r.tokens_per_second:>8.1f} "
            f"{sp:>8} {tau:>5}  {acc}"
        )
    return "\n".join(lines)


# ================================================================== decode-round costs (graphs vs eager)
def device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(rt: Any, prompts: list[list[int]], max_new_tokens: int, speculative: bool = True) -> dict:
    """One generation, with its rounds counted: ``tokens_s``, ``tau``, ``rounds``, ``round_ms`` (decode
    wall time per round, prefill excluded), ``prefill_ms``, ``new_tokens``."""
    device_sync(rt.device)
    t0 = time.perf_counter()
    run = rt._start(prompts, max_new_tokens, 0.0, 1.0, 0, 0, (), speculative, None)
    rounds, t_first = -1, None
    for _ in run:
        rounds += 1
        if t_first is None:
            t_first = time.perf_counter()
    wall = time.perf_counter() - t0
    out = run.result
    n = out.stats.num_new_tokens
    return dict(
        tokens_s=n / wall,
        tau=out.stats.mean_acceptance_length if speculative else 1.0,
        rounds=rounds,
        round_ms=(wall - (t_first - t0)) / max(rounds, 1) * 1e3,
        prefill_ms=(t_first - t0) * 1e3,
        new_tokens=n,
    )


def round_profile(rt: Any, prompts: list[list[int]], speculative: bool = True, rounds: int = 8) -> dict:
    """The cost of eager decode rounds, phase by phase (the device synchronised after each phase):
    ``draft_ms``, ``verify_ms``, ``commit_ms`` (means), and ``launches`` (device kernels and copies
    one round issues, counted by ``torch.profiler`` on CUDA; None elsewhere)."""
    dev, dec = rt.device, rt.decoder
    D = rt.spec.tree_depth if speculative else 0
    split = {"draft": 0.0, "verify": 0.0, "commit": 0.0}
    done = 0
    with torch.inference_mode():
        dec.prefill(prompts, speculative=speculative)
        room = rt.max_seq_len - rt.spec.verify_tokens - D - 2
        for i in range(rounds + 1):  # round 0 warms up
            if max(dec.lengths) >= room:
                break
            device_sync(dev)
            t0 = time.perf_counter()
            tree = dec.draft() if speculative else dec.root_tree()
            device_sync(dev)
            t1 = time.perf_counter()
            v = dec.verify(tree)
            device_sync(dev)
            t2 = time.perf_counter()
            dec.commit(tree, v)
            device_sync(dev)
            t3 = time.perf_counter()
            dec.collect()
            if i:
                split["draft"] += t1 - t0
                split["verify"] += t2 - t1
                split["commit"] += t3 - t2
                done += 1
        aten_ops = None
        if max(dec.lengths) < room:  # device-independent: aten ops one round dispatches (~ kernel launches)
            aten_ops = _count_aten_ops(dec.round)
            dec.collect()
        launches = None
        if dev.type == "cuda" and max(dec.lengths) < room:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as p:
                dec.round()
                device_sync(dev)
            launches = sum(1 for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    n = max(done, 1)
    return {f"{k}_ms": v / n * 1e3 for k, v in split.items()} | dict(
        launches=launches, aten_ops=aten_ops, profiled_rounds=done
    )


def _count_aten_ops(fn) -> int:
    """How many aten ops ``fn`` dispatches (views and metadata ops included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n
