"""``tritonspec export`` and ``save_pretrained``: what each serving system reads from the files written
(keys, dtypes, shapes), round trips, the compatibility report and its refusals, the official
SafeAILab layout, safe writing, and clear errors for broken drafter checkpoints.

The serving systems do not install here, so their loaders' reading of a config is simulated below
by small functions written from the rules read in their sources (``runtime/serving.py`` RULES);
the exporter's own code is not used to build them. Tests that name a gap of issue 15 fail on the
code before it (checked against a copy of that commit) and pass after.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tritonspec as ts
from tritonspec.cli import main
from tritonspec.runtime.errors import UserError

TARGET, D31 = ts.demo_pair("eagle3.1")
_, D3 = ts.demo_pair("eagle3")
N = json.loads((TARGET / "config.json").read_text())["num_hidden_layers"]  # 12: default aux ids (2, 6, 9)


# ---------------------------------------------------------------------------------------------- simulated loaders
def vllm_capture(cfg: dict) -> list[int]:
    """vLLM: gpu_model_runner._get_eagle3_aux_layers_from_config @4e17906 reads the top-level ids only;
    llama.py @e06c9ba captures before layer idx (boundary ids, used as they are)."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else [2, N // 2, N - 3]


def sglang_capture(cfg: dict) -> list[int]:
    """SGLang: model_runner @0005834 reads eagle_config's ids only; llama.py @0023954 adds 1."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return [i + 1 for i in ids] if ids is not None else [2, N // 2, N - 3]


def vllm_speculators_config(cfg: dict) -> dict:
    """vLLM's translation of a speculators config: base.py @9469974 (verifier -> target_model,
    transformer_layer_config copied flat) + algos.update_eagle3 @cfb173ab (forwards four keys only)."""
    flat = {"target_model": cfg["speculators_config"]["verifier"]["name_or_path"], **cfg["transformer_layer_config"]}
    flat["draft_vocab_size"] = cfg.get("draft_vocab_size")
    flat["norm_before_residual"] = cfg.get("norm_before_residual", True)
    if cfg.get("target_hidden_size") is not None:
        flat["target_hidden_size"] = cfg["target_hidden_size"]
    if cfg.get("eagle_aux_hidden_state_layer_ids"):
        flat["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_aux_hidden_state_layer_ids"]
    return flat


# ---------------------------------------------------------------------------------------------- helpers
def export(*args: str) -> int:
    return main(["export", *args])


def digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(d).iterdir())}


def same_weights(a: ts.Eagle3Drafter, b: ts.Eagle3Drafter) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


def greedy(drafter, prompts=("def add(a, b):\n", "import os\nimport sys\n"), n=24):
    rt = ts.SpeculativeRuntime.from_pretrained(
        TARGET, drafter, backend="torch", max_seq_len=256, spec=ts.SpecConfig(4, 2, 8), max_batch_size=2
    )
    out = rt.generate(list(prompts), max_new_tokens=n, stop_token_ids=[])
    return out.token_ids, out.stats.num_accepted_tokens, list(out.stats.accepted_per_position)


def write_official(src: Path, out: Path, max_positions: int = 1024) -> None:
    """An official SafeAILab EAGLE-3 checkpoint built from a drafter's tensors: LlamaForCausalLM config
    without aux ids or 3.1 keys, flat midlayer.* names, pytorch_model.bin."""
    c = json.loads((src / "config.json").read_text())
    out.mkdir(parents=True)
    keys = "hidden_size intermediate_size num_attention_heads num_key_value_heads rms_norm_eps vocab_size"
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1, "bias": False}
    cfg |= {k: c[k] for k in keys.split()} | {"draft_vocab_size": c["draft_vocab_size"], "rope_theta": 10000.0}
    cfg |= {"max_position_embeddings": max_positions, "hidden_act": "silu", "tie_word_embeddings": False}
    cfg |= {"bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"]}
    (out / "config.json").write_text(json.dumps(cfg))
    torch.save(load_file(str(src / "model.safetensors")), out / "pytorch_model.bin")


# ---------------------------------------------------------------------------------------------- format x system
H, I, V, VD = 128, 384, 4096, 2048
F = torch.bfloat16
LAYER_TENSORS = {
    "input_layernorm.weight": ([H], F),
    "hidden_norm.weight": ([H], F),
    "self_attn.q_proj.weight": ([H, 2 * H], F),
    "self_attn.k_proj.weight": ([64, 2 * H], F),
    "self_attn.v_proj.weight": ([64, 2 * H], F),
    "self_attn.o_proj.weight": ([H, H], F),
    "post_attention_layernorm.weight": ([H], F),
    "mlp.gate_proj.weight": ([I, H], F),
    "mlp.up_proj.weight": ([I, H], F),
    "mlp.down_proj.weight": ([H, I], F),
}
TOP_TENSORS = {
    "fc.weight": ([H, 3 * H], F),
    **{f"fc_norm.{i}.weight": ([H], F) for i in range(3)},
    "norm.weight": ([H], F),
    "lm_head.weight": ([VD, H], F),
    "d2t": ([VD], torch.int64),
    "t2d": ([V], torch.bool),
}
SIZES = {"hidden_size": H, "intermediate_size": I, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
SIZES |= {"num_hidden_layers": 1, "vocab_size": V, "max_position_embeddings": 2048, "rope_theta": 10000.0}
SWITCHES = {"fc_norm": True, "norm_output": True, "norm_before_fc": False, "num_aux_hidden_states": 3}
# What each serving system reads from the file of each format, per the rules of runtime/serving.py.
EXPECT = {
    ("eagle3", "vllm"): {
        "config": {
            "architectures": ["LlamaForCausalLMEagle3"],
            **SIZES,
            **SWITCHES,
            "draft_vocab_size": VD,
            "target_hidden_size": H,
            "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": [2, 6, 9],  # boundary ids, top level
        },
        "tensors": {**{f"midlayer.{k}": v for k, v in LAYER_TENSORS.items()}, **TOP_TENSORS},
    },
    ("eagle3", "sglang"): {
        "config": {
            "architectures": ["LlamaForCausalLMEagle3"],
            **SIZES,
            "fc_norm": True,
            "norm_output": True,
            "num_aux_hidden_states": 3,
            "draft_vocab_size": VD,
            "target_hidden_size": H,
            "eagle_config": {  # post-layer ids: SGLang adds 1
                "eagle_aux_hidden_state_layer_ids": [1, 5, 8],
                "use_aux_hidden_state": True,
                "fc_norm": True,
                "norm_output": True,
                "norm_before_fc": False,
            },
        },
        "tensors": {**{f"midlayer.{k}": v for k, v in LAYER_TENSORS.items()}, **TOP_TENSORS},
    },
    ("speculators", "vllm"): {
        "config": {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": {"model_type": "llama", **SIZES, **SWITCHES},
            **SWITCHES,
            "draft_vocab_size": VD,
            "target_hidden_size": H,
            "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": [2, 6, 9],
        },
        "tensors": {**{f"layers.0.{k}": v for k, v in LAYER_TENSORS.items()}, **TOP_TENSORS},
    },
}


def subset(want, got, where=""):
    """Every key of ``want`` is in ``got`` with the same value (recursing into dicts)."""
    for k, v in want.items():
        assert k in got, f"{where}{k} missing"
        if isinstance(v, dict):
            subset(v, got[k], f"{where}{k}.")
        else:
            assert got[k] == v, f"{where}{k}: {got[k]!r} != {v!r}"


@pytest.mark.parametrize("fmt,system", [*EXPECT, ("speculators", "sglang")])
def test_written_keys_dtypes_and_shapes_per_format_and_system(tmp_path, fmt, system):
    out = tmp_path / "o"
    argv = ["--dtype", "bfloat16", "--for", system]
    if (fmt, system) not in EXPECT:  # no SGLang loader reads the speculators format: refused, nothing written
        rc = export("--drafter", str(D31), "--out", str(out), "--format", fmt, "--target", str(TARGET), *argv)
        assert rc == 2 and not out.exists()
        return
    rc = export("--drafter", str(D31), "--out", str(out), "--format", fmt, "--target", str(TARGET), *argv, "--force")
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    subset(EXPECT[fmt, system]["config"], cfg)
    tensors = load_file(str(out / "model.safetensors"))
    assert {k: (list(v.shape), v.dtype) for k, v in tensors.items()} == EXPECT[fmt, system]["tensors"]
    assert (out / "serving_compatibility.md").exists()
    if system == "vllm":
        assert vllm_capture(cfg) == [2, 6, 9]
    else:
        assert sglang_capture(cfg) == [2, 6, 9]
    if fmt == "speculators":
        assert vllm_speculators_config(cfg)["target_model"] == str(TARGET.resolve())


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
@pytest.mark.parametrize("src", [D3, D31], ids=["eagle3", "eagle3.1"])
def test_round_trip_is_bit_identical_in_weights_and_flags(tmp_path, fmt, src):
    d = ts.Eagle3Drafter.from_pretrained(src)
    d.save_pretrained(tmp_path / "o", format=fmt, target=TARGET, serving="vllm")
    e = ts.Eagle3Drafter.from_pretrained(tmp_path / "o")
    assert e.config == d.config and same_weights(d, e)


def test_greedy_generation_identical_before_and_after_export(tmp_path):
    before = greedy(D31)
    assert export("--drafter", str(D31), "--out", str(tmp_path / "o"), "--target", "demo", "--for", "vllm") == 0
    after = greedy(str(tmp_path / "o"))
    assert after == before and before[1] > 0  # same tokens and the same accepted drafts


# ---------------------------------------------------------------------------------------------- the five gaps
def test_gap1_sglang_captures_the_layers_the_drafter_was_trained_on(tmp_path):
    ts.Eagle3Drafter.from_pretrained(D31).save_pretrained(tmp_path / "o")
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    trained = list(ts.Eagle3Drafter.from_pretrained(D31).config.aux_layer_ids)
    assert sglang_capture(cfg) == trained == vllm_capture(cfg) == [2, 6, 9]
    # a first id other than 2: SGLang files with the first-id rule (PR #25454) would read the ids as
    # boundaries; the report says so and the export for SGLang is refused without --force
    d = ts.Eagle3Drafter.from_pretrained(D3)
    d.config.aux_layer_ids = (3, 6, 9)
    with pytest.raises(UserError, match=r"sglang .*aux ids.*PR #25454.*--force"):
        d.save_pretrained(tmp_path / "p", target=TARGET, serving="sglang")
    d.save_pretrained(tmp_path / "p", target=TARGET, serving="vllm")  # vLLM reads boundary ids as they are
    assert sglang_capture(json.loads((tmp_path / "p" / "config.json").read_text())) == [3, 6, 9]


def test_gap2_a_flag_a_system_would_drop_refuses_the_export_naming_it(tmp_path, capsys):
    d = ts.Eagle3Drafter.from_pretrained(D3)
    d.config.norm_before_residual = True  # SGLang does not read it (any version read)
    d.save_pretrained(tmp_path / "nbr")
    out = tmp_path / "o"
    assert export("--drafter", str(tmp_path / "nbr"), "--out", str(out)) == 2  # default: --for all
    captured = capsys.readouterr()
    assert "loads but ignores norm_before_residual" in captured.out  # the printed table
    assert "norm_before_residual" in captured.err and "--force" in captured.err and not out.exists()
    assert export("--drafter", str(tmp_path / "nbr"), "--out", str(out), "--target", "demo", "--force") == 0
    report = (out / "serving_compatibility.md").read_text()
    assert "ignores norm_before_residual" in report and "sglang" in report and "vllm" in report
    # older SGLang drops fc_norm/norm_output without a word: the EAGLE-3.1 demo drafter is refused for SGLang
    assert export("--drafter", str(D31), "--out", str(tmp_path / "s"), "--target", "demo", "--for", "sglang") == 2
    err = capsys.readouterr().err
    assert "fc_norm" in err and "norm_output" in err and "@03d5a77" in err
    # vLLM before PR #42764 carries the pre-norm state whatever norm_output says
    d = ts.Eagle3Drafter.from_pretrained(D3)
    d.config.norm_output = True
    with pytest.raises(UserError, match=r"vllm would serve a different model .*ignores norm_output"):
        d.save_pretrained(tmp_path / "v", target=TARGET, serving="vllm")


def test_gap3_speculators_format_names_its_target_and_forwards_the_31_switches(tmp_path, capsys):
    out = tmp_path / "o"
    args = ["--drafter", str(D31), "--out", str(out), "--format", "speculators"]
    assert export(*args) == 2  # no target to record: refused, saying what to pass
    assert "--target" in capsys.readouterr().err and not out.exists()
    assert export(*args, "--target", str(TARGET), "--for", "vllm") == 0
    flat = vllm_speculators_config(json.loads((out / "config.json").read_text()))
    assert flat["target_model"] == str(TARGET.resolve())  # `vllm serve <out>` finds the target
    assert (flat["fc_norm"], flat["norm_output"], flat["norm_before_residual"]) == (True, True, False)


def test_gap4_official_safeailab_layout_converts_with_target_and_refuses_without(tmp_path, capsys):
    official = tmp_path / "official"
    write_official(D3, official)
    out = tmp_path / "o"
    assert export("--drafter", str(official), "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert "--target" in err and "(2, N//2, N-3)" in err and not out.exists()
    assert export("--drafter", str(official), "--out", str(out), "--target", str(TARGET)) == 0
    assert "max_position_embeddings 1024 -> 2048" in capsys.readouterr().out
    e, ref = ts.Eagle3Drafter.from_pretrained(out), ts.Eagle3Drafter.from_pretrained(D3)
    assert e.config == ref.config and same_weights(e, ref)
    assert e.config.aux_layer_ids == (2, N // 2, N - 3)
    assert greedy(str(out), n=16) == greedy(D3, n=16)


def test_gap5_flags_are_read_by_the_rules_of_the_system_that_writes_each_format(tmp_path):
    # LlamaForCausalLMEagle3 (SGLang's legacy key): fc_norm false + use_aux_norm true -> on, as SGLang ORs them
    d = tmp_path / "aux_norm"
    ts.Eagle3Drafter.from_pretrained(D31).save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("tritonspec")
    cfg["fc_norm"], cfg["use_aux_norm"] = False, True
    cfg["eagle_config"].pop("fc_norm")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="use_aux_norm"):
        assert ts.Eagle3Drafter.from_pretrained(d).config.fc_norm is True
    # speculators format without norm_before_residual: the speculators library's default (false), with a warning
    s = tmp_path / "spec"
    ts.Eagle3Drafter.from_pretrained(D3).save_pretrained(s, format="speculators")
    cfg = json.loads((s / "config.json").read_text())
    del cfg["norm_before_residual"]
    (s / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="norm_before_residual.*vLLM"):
        assert ts.Eagle3Drafter.from_pretrained(s).config.norm_before_residual is False


# ---------------------------------------------------------------------------------------------- safe writing
def test_export_refuses_a_non_empty_directory_unless_overwrite(tmp_path, capsys):
    import shutil

    model = tmp_path / "target_copy"
    shutil.copytree(TARGET, model)
    before = digest(model)
    assert export("--drafter", str(D3), "--out", str(model)) == 2
    assert "not empty" in capsys.readouterr().err
    assert digest(model) == before  # the target still loads
    ts.SpeculativeRuntime.from_pretrained(model, backend="torch", max_seq_len=64)
    with pytest.raises(UserError, match="holds another model"):  # Python default: never over another model
        ts.Eagle3Drafter.from_pretrained(D3).save_pretrained(model)
    assert export("--drafter", str(D3), "--out", str(model), "--overwrite", "--target", "demo") == 0
    assert same_weights(ts.Eagle3Drafter.from_pretrained(model), ts.Eagle3Drafter.from_pretrained(D3))
    assert (model / "tokenizer.json").exists() and not list(tmp_path.glob(".*tmp*"))
    assert export("--drafter", str(D3), "--out", str(model / "config.json")) == 2  # a file, not a directory
    assert "not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("existing", [True, False], ids=["overwrite", "new"])
def test_a_failure_while_writing_leaves_the_destination_as_it_was(tmp_path, monkeypatch, capsys, existing):
    import safetensors.torch

    from tritonspec.runtime import checkpoint

    out = tmp_path / "o"
    if existing:
        ts.Eagle3Drafter.from_pretrained(D31).save_pretrained(out)
        before = digest(out)

    def half_then_fail(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 1000)  # half a file, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", half_then_fail)
    monkeypatch.setattr(checkpoint, "save_file", half_then_fail, raising=False)
    if existing:
        with pytest.raises((OSError, ValueError), match="No space left on device"):
            ts.Eagle3Drafter.from_pretrained(D3).save_pretrained(out)  # replaces a previous drafter's files
        assert digest(out) == before
        assert export("--drafter", str(D3), "--out", str(out), "--overwrite") == 2
        assert digest(out) == before
    else:
        assert export("--drafter", str(D3), "--out", str(out)) == 2
        assert not out.exists()
    assert "No space left on device" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["o"] if existing else [])  # no temporary left


# ---------------------------------------------------------------------------------------------- broken checkpoints
def broken(tmp_path: Path, edit_config=None, edit_tensors=None) -> Path:
    d = tmp_path / "broken"
    ts.Eagle3Drafter.from_pretrained(D31).save_pretrained(d)
    if edit_config:
        cfg = json.loads((d / "config.json").read_text())
        edit_config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        from safetensors.torch import save_file

        t = load_file(str(d / "model.safetensors"))
        edit_tensors(t)
        save_file(t, str(d / "model.safetensors"))
    return d


def test_drafter_config_missing_a_key_names_it(tmp_path, capsys):
    d = broken(tmp_path, edit_config=lambda c: c.pop("hidden_size"))
    with pytest.raises(UserError, match=r"lacks 'hidden_size'"):
        ts.Eagle3Drafter.from_pretrained(d)
    assert export("--drafter", str(d), "--out", str(tmp_path / "o")) == 2
    assert "hidden_size" in capsys.readouterr().err


def test_d2t_out_of_range_is_refused_at_load(tmp_path):
    d = broken(tmp_path, edit_tensors=lambda t: t["d2t"].__setitem__(-1, 10**6))
    with pytest.raises(UserError, match=r"d2t maps 1 draft ids outside the target vocabulary \[0, 4096\)"):
        ts.Eagle3Drafter.from_pretrained(d)


def test_misshapen_tensor_names_tensor_expected_and_found(tmp_path):
    def transpose(t):
        t["midlayer.self_attn.q_proj.weight"] = t["midlayer.self_attn.q_proj.weight"].T.contiguous()

    d = broken(tmp_path, edit_tensors=transpose)
    with pytest.raises(UserError, match=r"midlayer.self_attn.q_proj.weight: expected \[128, 256\], found \[256, 128\]"):
        ts.Eagle3Drafter.from_pretrained(d)
    d = broken(tmp_path / "x", edit_tensors=lambda t: t.__setitem__("lm_head.weight", t["lm_head.weight"][:2000]))
    with pytest.raises(UserError, match=r"lm_head.weight: expected \[2048, 128\], found \[2000, 128\]"):
        ts.Eagle3Drafter.from_pretrained(d)


# ---------------------------------------------------------------------------------------------- the rules table
def test_rules_table_is_complete_and_sourced():
    from tritonspec.runtime.serving import FEATURES, LOADERS, RULES, rules

    for r in RULES:
        assert r.system and r.topic and r.rule and r.source and r.read_at, r
        assert r.outcome in ("honoured", "ignored", "fails", "info"), r
        assert r.loader == "" or r.loader in dict(LOADERS[r.system]), r
    for system, loaders in LOADERS.items():  # every drafter switch is judged for every loader version read
        for key, _ in loaders:
            for topic in FEATURES:
                assert [r for r in rules(system, topic) if r.loader in (key, "")], (system, key, topic)


def test_tensor_shapes_are_the_modules_state_dict():
    from tritonspec.runtime.drafter_config import DrafterConfig

    for flags in ({}, {"fc_norm": True}, {"norm_before_fc": True}):
        c = DrafterConfig(64, 96, 4, 2, 16, 100, 50, 48, num_aux_hidden_states=4, aux_layer_ids=(1, 2, 3, 4), **flags)
        sd = ts.Eagle3Drafter(c).state_dict()
        assert {k: tuple(v.shape) for k, v in sd.items()} == c.tensor_shapes()


def test_report_without_target_notes_what_it_could_not_check():
    from tritonspec.runtime.checkpoint import plan_export

    plan = plan_export(ts.Eagle3Drafter.from_pretrained(D3).config, "eagle3", serving="all")
    assert not plan.refusals() and "pass --target" in plan.report.table()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = plan_export(ts.Eagle3Drafter.from_pretrained(D3).config, "eagle3", target=TARGET, serving="all")
    assert plan.report.table().count("loads as trained") == 5 and not plan.report.notes
