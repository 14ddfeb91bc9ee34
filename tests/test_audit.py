"""``tritonspec audit`` (``runtime/audit.py``, ``cli/audit.py``): the certificate passes on a tiny
random pair, lists every file hash, and fails (exit status 1) on a deliberately broken verifier."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tritonspec.cli import main
from tritonspec.runtime.audit import audit, chi2_sf, file_hashes, law_check
from tritonspec.runtime.deterministic import DeterministicOps
from tritonspec.runtime.tiny import tiny_random_pair

SMALL = dict(max_new_tokens=10, batch_size=3, law_samples=96, law_prompts=1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_random_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 30, 1, 12)]


@pytest.mark.parametrize(
    "x, dof, want",
    [
        (3.841458820694124, 1, 0.05),
        (1.0, 2, math.exp(-0.5)),
        (20.0, 10, 0.029252688076961127),
        (10.0, 5, 0.07523524614651217),
        (250.0, 200, 0.0093791316688261),
        (0.0, 3, 1.0),
    ],
)
def test_chi2_survival_function(x, dof, want):
    assert chi2_sf(x, dof) == pytest.approx(want, rel=1e-3, abs=1e-12)


def test_law_check_accepts_the_law_and_rejects_another():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01, 0.0])
    g = torch.Generator().manual_seed(1)
    good = torch.multinomial(probs, 3000, replacement=True, generator=g).tolist()
    assert law_check(good, probs, 1e-3, 0, "first").ok
    skewed = torch.multinomial(torch.tensor([0.4, 0.4, 0.15, 0.04, 0.01, 0.0]), 3000, True, generator=g).tolist()
    bad = law_check(skewed, probs, 1e-3, 0, "first")
    assert not bad.ok and bad.p_value < 1e-3
    impossible = law_check(good[:-1] + [5], probs, 1e-3, 0, "first")  # a removed token drawn once
    assert not impossible.ok and impossible.impossible == 1


def test_audit_passes_and_lists_every_file(pair, prompts, tmp_path):
    tdir, ddir = pair
    report = audit(tdir, ddir, prompts, **SMALL)
    assert report.ok, [v.first_divergence for v in report.verdicts if not v.ok]
    assert {(v.prompt, v.mode) for v in report.verdicts} == {(i, m) for i in range(4) for m in ("greedy", "sampled")}
    assert all(set(v.checks) == {"speculative", "batched", "speculative+batched"} for v in report.verdicts)
    assert [x.token for x in report.laws][0] == "first" and all(x.ok for x in report.laws)
    assert report.files == {"target": file_hashes(tdir), "drafter": file_hashes(ddir)}
    listed = {f"{w}/{n}" for w, files in report.files.items() for n in files}
    on_disk = {f"target/{p.name}" for p in tdir.iterdir()} | {f"drafter/{p.name}" for p in ddir.iterdir()}
    assert listed == on_disk and any(n.endswith(".safetensors") for n in listed)
    md, js = report.write(tmp_path / "out")
    text = md.read_text()
    for name, digest in report.files["target"].items():
        assert f"target/{name}" in text and digest in text
    data = json.loads(js.read_text())
    assert data["ok"] and data["environment"]["torch"] == torch.__version__
    kernels = data["environment"]["cpu_kernels"]  # the CPU kernels' digests: comparable across machines
    assert set(kernels) == {"isa", "digest_float32", "digest_bfloat16"} and "CPU kernels" in text
    assert data["settings"]["batch_size"] == 3 and data["settings"]["seeds"].startswith("prompt i")
    assert any(p["op"] == "attention" for p in data["probes"])
    # rerunning gives the same digests (a comparable report)
    again = audit(tdir, ddir, prompts, **(SMALL | dict(law_samples=0)))
    assert [(v.tokens_sha256, v.logits_sha256) for v in again.verdicts] == [
        (v.tokens_sha256, v.logits_sha256) for v in report.verdicts
    ]


def _broken_verifier(monkeypatch):
    """Accept one wrong token: the first speculative round emits its bonus token + 1."""
    state = {"done": False}

    def verify_greedy(self, tokens, parents, target_argmax, max_depth):
        nodes, num, emitted = self.ops.verify_greedy(tokens, parents, target_argmax, max_depth)
        if max_depth > 0 and not state["done"]:
            state["done"] = True
            emitted = emitted.clone()
            emitted[0, num[0]] = (emitted[0, num[0]] + 1) % 257
        return nodes, num, emitted

    monkeypatch.setattr(DeterministicOps, "verify_greedy", verify_greedy, raising=False)


def test_audit_fails_on_a_broken_verifier(pair, prompts, monkeypatch):
    _broken_verifier(monkeypatch)
    report = audit(*pair, prompts[:2], **(SMALL | dict(temperature=0.0, law_samples=0)))
    assert not report.ok
    bad = [v for v in report.verdicts if not v.ok]
    assert bad and bad[0].first_divergence["way"] == "speculative" and "token" in bad[0].first_divergence["what"]
    assert "FAIL" in report.to_markdown()


def test_cli_audit_exit_status(pair, tmp_path, monkeypatch, capsys):
    tdir, ddir = pair
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\n    return x\n\nimport os\nprint(os.getcwd())\n")
    args = ["audit", "--target", str(tdir), "--drafter", str(ddir), "--prompts", str(prompts), "--max-new-tokens", "8"]
    args += ["--law-samples", "48", "--law-prompts", "1", "--out", str(tmp_path / "ok")]
    assert main(args) == 0
    assert "PASS" in capsys.readouterr().out and (tmp_path / "ok" / "audit.json").exists()
    _broken_verifier(monkeypatch)
    assert main([*args[:-1], str(tmp_path / "bad"), "--temperature", "0"]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert json.loads((tmp_path / "bad" / "audit.json").read_text())["ok"] is False
    assert main(["audit", "--target", str(tmp_path / "missing")]) == 2


def test_cli_generate_deterministic(pair, capsys):
    tdir, ddir = pair
    args = ["generate", "--target", str(tdir), "--drafter", str(ddir), "--max-new-tokens", "8", "--compare"]
    assert main([*args, "--deterministic", "def f(x):"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "deterministic=on" in line and "identical=True" in line
