"""Which serving systems load which drafter keys, and how: the rules read from their loaders
(``RULES``, the one table) and the compatibility report the exporter prints and writes next to a
checkpoint (``compatibility``).

Neither vLLM nor SGLang installs on the machines this package is tested on, so every rule below
was read from the systems' source files, at the commits given in ``read_at``. Where the index of
public code held a file only as a copy without repository or commit, ``read_at`` says so; where
a file was not found, the rule says "not found" instead of guessing. Rules name the drafter
feature they judge (``topic``) and what the loader does with it (``outcome``):

``honoured``  the loader builds and runs the feature as trained;
``ignored``   the loader loads the checkpoint but runs something else (a silently different model:
              the exporter refuses unless forced);
``fails``     the loader refuses the checkpoint or crashes on it (loud, so not refused by itself);
``info``      a convention the exporter follows (where a key is read, how ids are converted).

A rule with ``loader=""`` holds for every loader version of its system listed in ``LOADERS``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .drafter_config import DrafterConfig

VLLM, SGLANG = "vllm", "sglang"
SYSTEMS = (VLLM, SGLANG)
HONOURED, IGNORED, FAILS, INFO = "honoured", "ignored", "fails", "info"

# Loader versions the rules were read from, per system: key -> label (what the report prints).
LOADERS: dict[str, tuple[tuple[str, str], ...]] = {
    VLLM: (
        ("583507d", "llama_eagle3.py @583507d"),
        ("00bd149", "llama_eagle3.py @00bd149"),
        ("3.1", "llama_eagle3.py with fc_norm/norm_output (PR #42764)"),
    ),
    SGLANG: (
        ("old", "llama_eagle3.py @03d5a77, @d737979"),
        ("3.1", "llama_eagle3.py with fc_norm/norm_output (PR #24663)"),
    ),
}

_VLLM_L3 = "vllm/model_executor/models/llama_eagle3.py"
_SGL_L3 = "python/sglang/srt/models/llama_eagle3.py"
_V31 = "a copy stored without repository/commit (its text: fc_norm, norm_output, norm_before_fc, WeightsMapper)"
_S31 = "two annotated third-party copies; the upstream commit is not in the index"
_SPEC_ALGOS = "vllm/transformers_utils/configs/speculators/algos.py"


@dataclass(frozen=True)
class Rule:
    """One behaviour of one serving system's loader, with where it was read."""

    system: str  # vllm | sglang | speculators (the training library) | eagle (SafeAILab reference)
    loader: str  # a LOADERS key; "" = every loader version of the system
    topic: str  # the drafter feature judged (see FEATURES) or a convention
    outcome: str  # HONOURED | IGNORED | FAILS | INFO
    rule: str  # what the loader does
    source: str  # file, function
    read_at: str  # the versions (commits) the rule was read from


# fmt: off
RULES: tuple[Rule, ...] = (
    # ---------------------------------------------------------------- vLLM: the drafter module
    Rule(
        VLLM,
        "583507d",
        "fc_norm",
        FAILS,
        "no fc_norm modules; an fc_norm.{i}.weight tensor is looked up in params_dict -> KeyError",
        f"{_VLLM_L3}, LlamaModel.load_weights",
        "vllm-project/vllm@583507d",
    ),
    Rule(
        VLLM,
        "583507d",
        "norm_output",
        IGNORED,
        "the pre-norm state is always returned to the next draft step; norm_output is not read",
        f"{_VLLM_L3}, LlamaModel.forward",
        "vllm-project/vllm@583507d",
    ),
    Rule(
        VLLM,
        "583507d",
        "norm_before_fc",
        FAILS,
        "no input_norm module; input_norm.weight -> KeyError in params_dict",
        f"{_VLLM_L3}, LlamaModel.load_weights",
        "vllm-project/vllm@583507d",
    ),
    Rule(
        VLLM,
        "583507d",
        "norm_before_residual",
        IGNORED,
        "residual = the raw hidden state; norm_before_residual is not read",
        f"{_VLLM_L3}, LlamaDecoderLayer.forward",
        "vllm-project/vllm@583507d",
    ),
    Rule(
        VLLM,
        "583507d",
        "num_aux",
        FAILS,
        "fc = Linear(3 * target_hidden_size): another aux count does not fit fc.weight",
        f"{_VLLM_L3}, LlamaModel.__init__",
        "vllm-project/vllm@583507d",
    ),
    Rule(
        VLLM,
        "00bd149",
        "fc_norm",
        FAILS,
        "no fc_norm modules; an fc_norm.{i}.weight tensor is looked up in params_dict -> KeyError",
        f"{_VLLM_L3}, LlamaModel.load_weights",
        "vllm-project/vllm@00bd149",
    ),
    Rule(
        VLLM,
        "00bd149",
        "norm_output",
        IGNORED,
        "LlamaModel.forward returns (normed, pre-norm); the pre-norm state is always carried",
        f"{_VLLM_L3}, LlamaModel.forward",
        "vllm-project/vllm@00bd149",
    ),
    Rule(
        VLLM,
        "00bd149",
        "norm_before_fc",
        FAILS,
        "no input_norm module; input_norm.weight -> KeyError in params_dict",
        f"{_VLLM_L3}, LlamaModel.load_weights",
        "vllm-project/vllm@00bd149",
    ),
    Rule(
        VLLM,
        "00bd149",
        "norm_before_residual",
        HONOURED,
        "getattr(config, 'norm_before_residual', False) picks the residual (normed or raw)",
        f"{_VLLM_L3}, LlamaDecoderLayer.__init__",
        "vllm-project/vllm@00bd149",
    ),
    Rule(
        VLLM,
        "00bd149",
        "num_aux",
        FAILS,
        "fc input = target_hidden_size * 3: another aux count does not fit fc.weight",
        f"{_VLLM_L3}, LlamaModel.__init__",
        "vllm-project/vllm@00bd149",
    ),
    Rule(
        VLLM,
        "3.1",
        "fc_norm",
        HONOURED,
        "getattr(config, 'fc_norm', False) builds one RMSNorm per aux state, applied per chunk before fc",
        f"{_VLLM_L3}, LlamaModel.__init__ / Eagle3LlamaForCausalLM.combine_hidden_states",
        _V31,
    ),
    Rule(
        VLLM,
        "3.1",
        "norm_output",
        HONOURED,
        "getattr(config, 'norm_output', False): the post-norm state is carried to the next step",
        f"{_VLLM_L3}, LlamaModel.forward",
        _V31,
    ),
    Rule(
        VLLM,
        "3.1",
        "norm_before_fc",
        HONOURED,
        "eagle_config['norm_before_fc'], else the top-level key: one RMSNorm over the concatenation",
        f"{_VLLM_L3}, LlamaModel.__init__ / combine_hidden_states",
        _V31,
    ),
    Rule(
        VLLM,
        "3.1",
        "norm_before_residual",
        HONOURED,
        "getattr(config, 'norm_before_residual', False)",
        f"{_VLLM_L3}, LlamaDecoderLayer.__init__",
        _V31,
    ),
    Rule(
        VLLM,
        "3.1",
        "num_aux",
        HONOURED,
        "num_aux_hidden_states, else len(eagle_config ids), else 3",
        f"{_VLLM_L3}, LlamaModel.__init__",
        _V31,
    ),
    # ---------------------------------------------------------------- vLLM: around the module
    Rule(
        VLLM,
        "",
        "aux_ids",
        INFO,
        "reads the TOP-LEVEL eagle_aux_hidden_state_layer_ids only (not eagle_config) and uses the ids "
        "as they are; without them the target's default (2, N//2, N-3)",
        "vllm/v1/worker/gpu_model_runner.py, GPUModelRunner._get_eagle3_aux_layers_from_config / load_model",
        "vllm-project/vllm@4e17906",
    ),
    Rule(
        VLLM,
        "",
        "aux_convention",
        INFO,
        "boundary ids: hidden + residual is captured BEFORE layer idx for idx in range(N); idx 0 adds a "
        "residual that is still None (crash), idx N is never reached",
        "vllm/model_executor/models/llama.py, LlamaModel.forward / LlamaForCausalLM.get_eagle3_aux_hidden_state_layers",
        "vllm-project/vllm@e06c9ba",
    ),
    Rule(
        VLLM,
        "",
        "d2t",
        INFO,
        "d2t -> draft_id_to_target_id (target = draft + d2t); t2d is skipped; midlayer. -> layers.0.",
        f"{_VLLM_L3}, Eagle3LlamaForCausalLM.load_weights / LlamaModel.load_weights",
        "vllm-project/vllm@583507d, @00bd149; " + _V31,
    ),
    Rule(
        VLLM,
        "",
        "verifier",
        INFO,
        "speculators format: target_model = speculators_config.verifier.name_or_path (what `vllm serve "
        "<drafter dir>` serves as the target); transformer_layer_config keys are copied into the flat config",
        "vllm/transformers_utils/configs/speculators/base.py, SpeculatorsConfig.convert_speculators_to_vllm",
        "vllm-project/vllm@9469974",
    ),
    Rule(
        VLLM,
        "",
        "speculators_flags",
        INFO,
        "update_eagle3 forwards draft_vocab_size, target_hidden_size, norm_before_residual (default True) and "
        "eagle_aux_hidden_state_layer_ids only: a top-level fc_norm/norm_output/norm_before_fc is dropped "
        "(the exporter also writes them into transformer_layer_config, which base.py copies)",
        f"{_SPEC_ALGOS}, update_eagle3",
        "vllm-project/vllm@cfb173ab",
    ),
    Rule(
        VLLM,
        "",
        "speculators_flags",
        INFO,
        "update_eagle3 also forwards norm_before_fc, fc_norm, norm_output (default False); norm_before_residual "
        "still defaults to True (PRs #38111, #46488)",
        f"{_SPEC_ALGOS}, update_eagle3",
        "a copy stored without repository/commit",
    ),
    # ---------------------------------------------------------------- SGLang: the drafter module
    Rule(
        SGLANG,
        "old",
        "fc_norm",
        IGNORED,
        "no fc_norm modules; load_weights skips names not in params_dict without a word",
        f"{_SGL_L3}, LlamaModel.__init__ / LlamaForCausalLMEagle3.load_weights",
        "sgl-project/sglang@03d5a77, @d737979",
    ),
    Rule(
        SGLANG,
        "old",
        "norm_output",
        IGNORED,
        "the pre-norm state is always returned as the next step's hidden state",
        f"{_SGL_L3}, LlamaModel.forward",
        "sgl-project/sglang@03d5a77, @d737979",
    ),
    Rule(
        SGLANG,
        "old",
        "norm_before_fc",
        IGNORED,
        "no input_norm module; input_norm.weight is skipped without a word",
        f"{_SGL_L3}, LlamaForCausalLMEagle3.load_weights",
        "sgl-project/sglang@03d5a77, @d737979",
    ),
    Rule(
        SGLANG,
        "old",
        "norm_before_residual",
        IGNORED,
        "residual = the raw hidden state; the key is not read",
        f"{_SGL_L3}, LlamaDecoderLayer.forward",
        "sgl-project/sglang@03d5a77, @d737979",
    ),
    Rule(
        SGLANG,
        "old",
        "num_aux",
        FAILS,
        "fc = Linear(hidden_size_in * 3): another aux count does not fit fc.weight",
        f"{_SGL_L3}, LlamaModel.__init__",
        "sgl-project/sglang@03d5a77, @d737979",
    ),
    Rule(
        SGLANG,
        "3.1",
        "fc_norm",
        HONOURED,
        "fc_norm OR the legacy use_aux_norm builds per-aux RMSNorms; aux_norm_{low,mid,high} -> fc_norm.{0,1,2}",
        f"{_SGL_L3}, LlamaModel.__init__ / LlamaForCausalLMEagle3.load_weights",
        _S31,
    ),
    Rule(
        SGLANG,
        "3.1",
        "norm_output",
        HONOURED,
        "getattr(config, 'norm_output', False): the post-norm state is carried",
        f"{_SGL_L3}, LlamaModel.forward",
        _S31,
    ),
    Rule(
        SGLANG,
        "3.1",
        "norm_before_fc",
        IGNORED,
        "not read; input_norm.weight is skipped without a word (PR #32334 adds it for gpt-oss drafters: "
        "that code was not read)",
        f"{_SGL_L3}, LlamaForCausalLMEagle3.load_weights",
        _S31,
    ),
    Rule(
        SGLANG,
        "3.1",
        "norm_before_residual",
        IGNORED,
        "residual = the raw hidden state; the key is not read",
        f"{_SGL_L3}, LlamaDecoderLayer.forward",
        _S31,
    ),
    Rule(
        SGLANG,
        "3.1",
        "num_aux",
        HONOURED,
        "num_aux_hidden_states, else len(eagle_config ids), else 3",
        f"{_SGL_L3}, LlamaModel.__init__",
        _S31,
    ),
    # ---------------------------------------------------------------- SGLang: around the module
    Rule(
        SGLANG,
        "",
        "aux_ids",
        INFO,
        "reads eagle_config['eagle_aux_hidden_state_layer_ids'] only (not the top-level key); none -> default",
        "python/sglang/srt/model_executor/model_runner.py, ModelRunner.__init__",
        "sgl-project/sglang@0005834",
    ),
    Rule(
        SGLANG,
        "",
        "aux_convention",
        INFO,
        "post-layer ids: layers_to_capture = [id + 1 for id in ids] (default [2, N//2, N-3] without +1); "
        "hidden + residual is captured before layer i for i in range(N): capture 0 crashes (residual None), "
        "capture N is never reached",
        "python/sglang/srt/models/llama.py, LlamaForCausalLM.set_eagle3_layers_to_capture / LlamaModel.forward",
        "sgl-project/sglang@0023954 (qwen3.py, glm4_moe_lite.py copies: the same +1)",
    ),
    Rule(
        SGLANG,
        "",
        "aux_first_id_rule",
        INFO,
        "PR #25454: +1 only when the first id is 1, else the ids are used as boundaries; seen in some model "
        "files, not in llama.py@0023954",
        "set_eagle3_layers_to_capture of an SGLang model file (an annotated copy; the file was not identified)",
        "sgl-project/sglang PR #25454 (2026-05-16)",
    ),
    Rule(
        SGLANG,
        "",
        "d2t",
        INFO,
        "hot_token_id = d2t + arange (target = draft + d2t); t2d is skipped; legacy names mapped",
        f"{_SGL_L3}, LlamaForCausalLMEagle3.load_weights",
        "sgl-project/sglang@03d5a77, @d737979; " + _S31,
    ),
    Rule(
        SGLANG,
        "",
        "speculators_format",
        FAILS,
        "no SGLang loader for the speculators format (Eagle3Speculator) was found; llama_eagle3.py registers "
        "LlamaForCausalLMEagle3 only",
        f"{_SGL_L3}, EntryClass",
        "sgl-project/sglang@03d5a77, @d737979; " + _S31,
    ),
    # ---------------------------------------------------------------- writers whose defaults matter on read
    Rule(
        "speculators",
        "",
        "norm_before_residual",
        INFO,
        "Eagle3SpeculatorConfig.norm_before_residual defaults to False (vLLM's translation defaults to True)",
        "src/speculators/models/eagle3/config.py, Eagle3SpeculatorConfig",
        "vllm-project/speculators@27ec382",
    ),
    Rule(
        "eagle",
        "",
        "aux_ids",
        INFO,
        "official EAGLE-3 configs record no aux ids: the reference code captures boundaries (2, N//2, N-3) "
        "of the target, hard-coded",
        "eagle/model/modeling_llama_kv.py (via ../shared/reference/eagle-spec.md section 2.1)",
        "SafeAILab/EAGLE@cb7e084",
    ),
)
# fmt: on

# The drafter features the report judges, with the words it uses for them.
FEATURES = {
    "fc_norm": "fc_norm",
    "norm_output": "norm_output",
    "norm_before_fc": "norm_before_fc",
    "norm_before_residual": "norm_before_residual",
    "num_aux": "num_aux_hidden_states != 3",
}


def rules(system: str | None = None, topic: str | None = None) -> list[Rule]:
    """The rows of ``RULES`` for a system and/or topic."""
    return [r for r in RULES if (system is None or r.system == system) and (topic is None or r.topic == topic)]


def _outcome(system: str, loader: str, topic: str) -> Rule | None:
    for r in RULES:
        if r.system == system and r.topic == topic and r.loader in (loader, ""):
            return r
    return None


@dataclass
class Row:
    """The verdict for one loader version: ``status`` is HONOURED (loads as trained), IGNORED or FAILS."""

    system: str
    loader: str
    status: str
    ignored: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def verdict(self) -> str:
        if self.status == FAILS:
            return "fails to load: " + "; ".join(self.failures)
        if self.status == IGNORED:
            return "loads but ignores " + ", ".join(self.ignored)
        return "loads as trained"


@dataclass
class Report:
    """A compatibility report: one row per (system, loader version), and the refusals it implies."""

    format: str
    rows: list[Row]
    notes: list[str] = field(default_factory=list)

    def refusals(self) -> list[str]:
        """One reason per system that would serve a different model (a row that ignores a feature)
        or that no version read loads."""
        out = []
        for system in dict.fromkeys(r.system for r in self.rows):
            rows = [r for r in self.rows if r.system == system]
            silent = [r for r in rows if r.status == IGNORED]
            if silent:
                what = "; ".join(f"{r.loader} ignores {', '.join(r.ignored)}" for r in silent)
                out.append(f"{system} would serve a different model ({what})")
            elif not any(r.status == HONOURED for r in rows):
                out.append(f"no {system} version read loads it ({rows[0].failures[0] if rows else 'no loader'})")
        return out

    def table(self) -> str:
        """The report as an aligned text table (what ``tritonspec export`` prints and writes)."""
        head = ("system", "loader (version read)", "verdict")
        body = [(r.system, r.loader, r.verdict()) for r in self.rows]
        w0 = max(len(x[0]) for x in [head, *body])
        w1 = max(len(x[1]) for x in [head, *body])
        lines = [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in [head, *body]]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def markdown(self) -> str:
        """The report as written next to the checkpoint (``serving_compatibility.md``)."""
        out = [
            f"# Serving compatibility ({self.format} format)",
            "",
            "Written by `tritonspec export`. Rules read from the loaders' sources "
            "(`tritonspec.runtime.serving.RULES`).",
            "",
            "| system | loader (version read) | verdict |",
            "|---|---|---|",
        ]
        out += [f"| {r.system} | {r.loader} | {r.verdict()} |" for r in self.rows]
        out += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(out) + "\n"


def sglang_aux_ids(boundary_ids: tuple[int, ...]) -> list[int]:
    """What the exporter writes to ``eagle_config`` for SGLang: post-layer ids (boundary - 1), which
    ``set_eagle3_layers_to_capture`` turns back into the boundaries by adding 1."""
    return [int(b) - 1 for b in boundary_ids]


def compatibility(
    config: DrafterConfig,
    format: str,
    systems: tuple[str, ...] = SYSTEMS,
    *,
    num_target_layers: int | None = None,
    verifier: str | None = None,
) -> Report:
    """Judge a drafter ``config`` written in ``format`` against every loader version of ``systems``
    read in ``RULES``. ``num_target_layers`` (the target's N) checks the upper bound of the aux
    ids; ``verifier`` is the target name the speculators format records."""
    active = [
        t
        for t, on in (
            ("fc_norm", config.fc_norm),
            ("norm_output", config.norm_output),
            ("norm_before_fc", config.norm_before_fc),
            ("norm_before_residual", config.norm_before_residual),
            ("num_aux", config.num_aux_hidden_states != 3),
        )
        if on
    ]
    notes: list[str] = []
    aux_fail, aux_ignored = _aux_problems(config.aux_layer_ids, num_target_layers, notes)
    rows = []
    for system in systems:
        for key, label in LOADERS[system]:
            row = Row(system, label, HONOURED)
            if system == SGLANG and format == "speculators":
                row.failures.append("the speculators format has no SGLang loader (use --format eagle3)")
            if system == VLLM and format == "speculators" and not verifier:
                row.failures.append(
                    "verifier.name_or_path is null, so `vllm serve <drafter dir>` cannot find the target "
                    "(pass --target)"
                )
            row.failures += aux_fail
            if system == SGLANG:
                row.ignored += aux_ignored
            for topic in active:
                rule = _outcome(system, key, topic)
                if rule is None or rule.outcome == HONOURED:
                    continue
                if rule.outcome == FAILS:
                    row.failures.append(f"{FEATURES[topic]}: {rule.rule}")
                else:
                    row.ignored.append(FEATURES[topic])
            row.status = FAILS if row.failures else IGNORED if row.ignored else HONOURED
            rows.append(row)
    return Report(format, rows, notes)


def _aux_problems(ids: tuple[int, ...] | None, n: int | None, notes: list[str]) -> tuple[list[str], list[str]]:
    """(failures for every loader, features SGLang would ignore) of boundary aux ids."""
    if ids is None:
        return ["no aux layer ids recorded"], []
    fail = []
    if min(ids) < 1:
        fail.append(f"aux boundary 0 (embeddings) in {list(ids)} cannot be captured (the capture adds a None residual)")
    if n is not None and max(ids) >= n:
        fail.append(f"aux boundary {max(ids)} >= the target's {n} layers is never captured")
    if n is None:
        notes.append("the target is unknown: aux ids were not checked against its layer count (pass --target)")
    ignored = []
    if ids[0] != 2:
        ignored.append(
            f"aux ids (SGLang model files with PR #25454's first-id rule read {sglang_aux_ids(ids)} as "
            f"boundaries and capture {sglang_aux_ids(ids)} instead of {list(ids)})"
        )
    return fail, ignored
