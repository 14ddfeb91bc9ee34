"""The repository root is the package's folder: run from a checkout, ``python -m`` puts it first on
``sys.path``, where ``kernels/`` would shadow the ``kernels`` distribution transformers >= 5.25
imports. Importing tritonspec takes the folder off ``sys.path``."""

import subprocess
import sys
from pathlib import Path

import tritonspec

ROOT = Path(tritonspec.__file__).resolve().parent
PROBE = "import sys; sys.path.insert(0, ''); {pre}import kernels; print(getattr(kernels, '__file__', None))"


def _kernels_origin(pre: str) -> str:
    r = subprocess.run([sys.executable, "-c", PROBE.format(pre=pre)], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:  # ModuleNotFoundError where no `kernels` distribution is installed
        return (r.stdout + r.stderr.strip().splitlines()[-1]).strip()
    return r.stdout.strip()


def test_importing_tritonspec_unshadows_the_kernels_distribution():
    origin = _kernels_origin("import tritonspec; print('imported'); ")
    assert origin.startswith("imported"), f"import tritonspec failed: {origin}"
    origin = origin.removeprefix("imported").strip()
    assert not origin.startswith(str(ROOT)), f"`import kernels` still finds the checkout's folder: {origin}"


def test_inverse_without_tritonspec_the_checkout_shadows_it():
    # the probe can fail: run from the checkout without tritonspec, `import kernels` finds ours
    assert _kernels_origin("").startswith(str(ROOT / "kernels"))


def test_a_top_level_module_imported_from_the_checkout_is_forgotten():
    code = (
        "import sys; sys.path.insert(0, ''); import kernels.store; import tritonspec; "
        "print('kernels' in sys.modules, 'kernels.store' in sys.modules, '' in sys.path)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert r.stdout.split() == ["False", "False", "False"]
