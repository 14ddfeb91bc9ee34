"""The per-device config store: round trip, nearest bucket, mismatch/corrupt handling, the
environment override, in-memory caching, and the launchers' config functions reading it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from tritonspec.kernels import store
from tritonspec.kernels.store import TunedConfigWarning, config_filename, make_table, nearest_bucket, tuned, write_table

CPU = torch.device("cpu")


def _write(d, op="rms_norm", configs=None, dtype="float32", **overrides):
    table = make_table(
        op, "hidden_size", configs or {1024: {"num_warps": 2}, 4096: {"num_warps": 8}}, dtype=dtype, device=CPU
    )
    table.update(overrides)
    return write_table(table, d)


def _no_warnings():
    return warnings.catch_warnings(record=True)


def test_round_trip_vllm_name_and_stamp(tuned_dir):
    path = _write(tuned_dir, timings_us={"1024": {"default": 3.0, "best": 2.0}})
    assert path.name == "rms_norm,device_name=cpu,dtype=float32.json"
    data = json.loads(path.read_text())
    assert data["versions"]["tritonspec"] and data["versions"]["triton"] and data["versions"]["torch"]
    assert data["device_name"] == "cpu" and "compute_capability" in data
    assert tuned("rms_norm", 1024, {"num_warps": 4}, dtype=torch.float32, device=CPU) == {"num_warps": 2}
    # another dtype has no file: the default, silently on the CPU
    with _no_warnings() as w:
        warnings.simplefilter("always")
        assert tuned("rms_norm", 1024, {"num_warps": 4}, dtype=torch.bfloat16, device=CPU) == {"num_warps": 4}
    assert not [x for x in w if issubclass(x.category, TunedConfigWarning)]


def test_write_merges_buckets(tuned_dir):
    _write(tuned_dir, configs={1024: {"num_warps": 2}})
    path = _write(tuned_dir, configs={8192: {"num_warps": 16}})
    assert set(json.loads(path.read_text())["configs"]) == {"1024", "8192"}


@pytest.mark.parametrize("value, want", [(1, "1024"), (2000, "1024"), (2560, "1024"), (2561, "4096"), (10**6, "4096")])
def test_nearest_bucket(value, want):
    assert nearest_bucket(["4096", "1024", "x"], value) == want  # ties go to the smaller bucket
    assert nearest_bucket([], value) is None


def test_lookup_uses_nearest_bucket(tuned_dir):
    _write(tuned_dir)
    for h, w in [(64, 2), (2500, 2), (3000, 8), (65536, 8)]:
        assert tuned("rms_norm", h, {"num_warps": 1}, dtype="float32", device=CPU)["num_warps"] == w


def test_only_default_keys_and_positive_ints_are_taken(tuned_dir):
    _write(tuned_dir, configs={64: {"num_warps": 4, "evil": 1}})
    assert tuned("rms_norm", 64, {"num_warps": 1}, dtype="float32", device=CPU) == {"num_warps": 4}
    store.clear_cache()
    _write(tuned_dir, configs={64: {"num_warps": "eight"}})
    with pytest.warns(TunedConfigWarning, match="malformed"):
        assert tuned("rms_norm", 64, {"num_warps": 1}, dtype="float32", device=CPU) == {"num_warps": 1}


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("device_name", "NVIDIA_H100_80GB_HBM3", "tuned on"),
        ("versions", {"tritonspec": "0.0.1", "triton": "3.6.0", "torch": "2.11.0"}, "tritonspec"),
        ("versions", None, "tritonspec"),
    ],
)
def test_mismatched_file_warns_once_and_falls_back(tuned_dir, field, value, why):
    table = make_table("rms_norm", "hidden_size", {64: {"num_warps": 8}}, dtype="float32", device=CPU)
    table[field] = value
    (tuned_dir).mkdir(parents=True, exist_ok=True)
    (tuned_dir / config_filename("rms_norm", "cpu", "float32")).write_text(json.dumps(table))
    with pytest.warns(TunedConfigWarning, match=why):
        assert tuned("rms_norm", 64, {"num_warps": 1}, dtype="float32", device=CPU) == {"num_warps": 1}
    with _no_warnings() as w:  # once: the next shape does not warn again
        warnings.simplefilter("always")
        assert tuned("rms_norm", 128, {"num_warps": 1}, dtype="float32", device=CPU) == {"num_warps": 1}
    assert not [x for x in w if issubclass(x.category, TunedConfigWarning)]


def test_triton_version_mismatch(tuned_dir):
    table = make_table("rms_norm", "hidden_size", {64: {"num_warps": 8}}, dtype="float32", device=CPU)
    table["versions"]["triton"] = "2.1.0"
    write_table(table, tuned_dir)
    with pytest.warns(TunedConfigWarning, match="Triton 2.1.0"):
        assert tuned("rms_norm", 64, {"num_warps": 1}, dtype="float32", device=CPU) == {"num_warps": 1}


def test_gpu_name_and_capability_checked(tuned_dir, monkeypatch):
    """On a (pretend) H200: a file for sm_80 is refused; a missing file warns; the right one is used."""
    monkeypatch.setattr(store, "device_name", lambda device=None: "NVIDIA_H200")
    monkeypatch.setattr(store, "compute_capability", lambda device=None: [9, 0])
    with pytest.warns(TunedConfigWarning, match="no tuned rms_norm configs for NVIDIA_H200"):
        assert tuned("rms_norm", 64, {"num_warps": 1}, dtype="bfloat16", device=CPU) == {"num_warps": 1}
    store.clear_cache()
    table = make_table("rms_norm", "hidden_size", {64: {"num_warps": 8}}, dtype="bfloat16", name="NVIDIA_H200")
    table["compute_capability"] = [8, 0]
    write_table(table, tuned_dir)
    with pytest.warns(TunedConfigWarning, match="compute capability"):
        assert tuned("rms_norm", 64, {"num_warps": 1}, dtype="bfloat16", device=CPU) == {"num_warps": 1}
    table["compute_capability"] = [9, 0]
    write_table(table, tuned_dir)
    assert tuned("rms_norm", 64, {"num_warps": 1}, dtype="bfloat16", device=CPU) == {"num_warps": 8}


def test_corrupt_file_warns_and_falls_back(tuned_dir):
    tuned_dir.mkdir(parents=True)
    (tuned_dir / config_filename("rms_norm", "cpu", "float32")).write_text("{not json")
    with pytest.warns(TunedConfigWarning, match="corrupt"):
        assert tuned("rms_norm", 64, {"num_warps": 1}, dtype="float32", device=CPU) == {"num_warps": 1}
    (tuned_dir / config_filename("aux_gather", "cpu", "float32")).write_text('{"configs": [1, 2]}')
    with pytest.warns(TunedConfigWarning, match="configs"):
        assert tuned("aux_gather", 64, {"num_warps": 1}, dtype="float32", device=CPU) == {"num_warps": 1}


def test_env_override_and_default_folders(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, configs={64: {"num_warps": 2}})
    _write(b, configs={64: {"num_warps": 4}})
    monkeypatch.setenv(store.ENV_DIR, str(a))
    assert store.search_dirs() == [a] and store.user_dir() == a
    assert tuned("rms_norm", 64, {"num_warps": 1}, dtype="float32", device=CPU)["num_warps"] == 2
    monkeypatch.setenv(store.ENV_DIR, str(b))
    store.clear_cache()
    assert tuned("rms_norm", 64, {"num_warps": 1}, dtype="float32", device=CPU)["num_warps"] == 4
    monkeypatch.delenv(store.ENV_DIR)
    monkeypatch.setenv("TRITONSPEC_CACHE", str(tmp_path / "cache"))
    assert store.search_dirs() == [tmp_path / "cache" / "tuned", store.SHIPPED_DIR]
    assert store.user_dir() == tmp_path / "cache" / "tuned"


def test_lookups_are_cached_without_file_io(tuned_dir, monkeypatch):
    _write(tuned_dir)
    assert tuned("rms_norm", 4096, {"num_warps": 1}, dtype="float32", device=CPU)["num_warps"] == 8

    def boom(*a, **k):
        raise AssertionError("file I/O on a cached lookup")

    monkeypatch.setattr(store, "load_table", boom)
    for _ in range(3):
        assert tuned("rms_norm", 4096, {"num_warps": 1}, dtype="float32", device=CPU)["num_warps"] == 8


def test_forced_config_wins_inside_the_block(tuned_dir):
    _write(tuned_dir)
    with store.forced("rms_norm", {"num_warps": 16}):
        assert tuned("rms_norm", 4096, {"num_warps": 1}, dtype="float32", device=CPU)["num_warps"] == 16
        assert tuned("rms_norm", 4096, {"num_warps": 1}, dtype=None, device=None)["num_warps"] == 16
    assert tuned("rms_norm", 4096, {"num_warps": 1}, dtype="float32", device=CPU)["num_warps"] == 8


def test_launcher_config_functions_read_the_store(tuned_dir):
    from tritonspec.kernels.aux_gather import gather_config
    from tritonspec.kernels.kv_compact import compact_config
    from tritonspec.kernels.tree_attention import SPLIT_KV, _attention_constexprs, attention_config
    from tritonspec.kernels.utils import rms_config
    from tritonspec.kernels.verify import verify_config

    heuristic = rms_config(4096)
    assert rms_config(4096, torch.float32, CPU) == heuristic  # nothing stored yet
    _write(tuned_dir, configs={4096: {"num_warps": 2}})
    write_table(
        make_table("aux_gather", "hidden_size", {4096: {"num_warps": 1}}, dtype="float32", device=CPU), tuned_dir
    )
    write_table(
        make_table("verify_greedy", "num_draft_tokens", {48: {"num_warps": 4}}, dtype="int64", device=CPU), tuned_dir
    )
    write_table(
        make_table("kv_compact", "kv_width", {1024: {"BLOCK_C": 256, "num_warps": 2}}, dtype="float32", device=CPU),
        tuned_dir,
    )
    # tree attention: one valid entry (head_dim 128) and one whose split is no multiple of BLOCK_N (head_dim 64)
    write_table(
        make_table(
            "tree_attention",
            "head_dim",
            {
                64: dict(BLOCK_M=32, BLOCK_N=64, num_warps=8, num_stages=3, split_kv=1000),
                128: dict(BLOCK_M=32, BLOCK_N=32, num_warps=8, num_stages=3, split_kv=1024),
            },
            dtype="float32",
            device=CPU,
        ),
        tuned_dir,
    )
    assert rms_config(4096, torch.float32, CPU) == (heuristic[0], 2)
    assert rms_config(4096) == heuristic  # no device: the heuristic (what the PTX compile test compiles)
    assert gather_config(4096, torch.float32, CPU)[1] == 1
    assert verify_config(40, CPU) == 4
    assert compact_config(1024, 8, torch.float32, CPU) == (256, 2)
    t = attention_config(128, torch.float32, CPU)
    assert (t["BLOCK_M"], t["BLOCK_N"], t["split_kv"], t["num_stages"]) == (32, 32, 1024, 3)
    assert _attention_constexprs(128, torch.float32, CPU)["BLOCK_N"] == 32
    assert attention_config(64, torch.float32, CPU)["split_kv"] == SPLIT_KV  # invalid entry: the heuristic


def test_package_version_and_shipped_folder():
    """One version (installed metadata) stamps the files and is ``tritonspec.__version__``; the shipped
    configs sit beside the store."""
    import tritonspec

    assert store.versions()["tritonspec"] == store.package_version() == tritonspec.__version__
    assert store.SHIPPED_DIR.is_dir() and store.SHIPPED_DIR.parent == Path(store.__file__).resolve().parent
