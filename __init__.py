"""tritonspec: EAGLE-3 / EAGLE-3.1 speculative decoding for Hugging Face LLMs.

>>> import tritonspec as ts
>>> ts.SpecConfig.chain(4)
SpecConfig(num_speculative_tokens=4, top_k=1, num_draft_tokens=5)
"""

import os as _os
import sys as _sys


def _unshadow() -> None:
    """Take this package's own folder off ``sys.path``. The folder is the repository root, and
    ``python -m ...`` run from a checkout puts the working directory first on ``sys.path``, where
    our subfolders would shadow installed distributions of the same top-level name: transformers
    >= 5.25 imports the ``kernels`` distribution (Hugging Face's hub kernels) and got ours. Our
    modules are reached as ``tritonspec.*`` only; a top-level module already imported from the
    folder (``runtime``, ``runtime.errors``, ...) is forgotten as well. A transformers import made
    before tritonspec's, from a checkout, still gets the distribution where one is installed:
    ``kernels/__init__.py``, imported as a top-level module, loads it in its place (tests/test_unshadow.py)."""
    here = _os.path.dirname(_os.path.realpath(__file__))
    _sys.path[:] = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != here]
    for name, mod in list(_sys.modules.items()):
        top = _os.path.join(here, name.split(".")[0])
        if not _os.path.isfile(_os.path.join(top, "__init__.py")):  # our packages only (not tests/, perf/)
            continue
        if _os.path.realpath(getattr(mod, "__file__", None) or "").startswith(top + _os.sep):
            del _sys.modules[name]  # e.g. ``kernels`` from this folder, not the distribution


_unshadow()

from .demo import demo_pair  # noqa: E402
from .drafters import shipped_drafter  # noqa: E402
from .kernels.store import package_version  # noqa: E402
from .runtime.config import GenerationOutput, SpecConfig, SpecStats  # noqa: E402
from .runtime.drafter import DrafterConfig, Eagle3Drafter  # noqa: E402
from .runtime.engine import SpeculativeRuntime  # noqa: E402
from .runtime.errors import UserError  # noqa: E402
from .runtime.target import SUPPORTED_ARCHITECTURES, TargetModel  # noqa: E402

__version__ = package_version()
__all__ = [
    "SpeculativeRuntime",
    "SpecConfig",
    "SpecStats",
    "GenerationOutput",
    "Eagle3Drafter",
    "DrafterConfig",
    "TargetModel",
    "SUPPORTED_ARCHITECTURES",
    "UserError",
    "demo_pair",
    "shipped_drafter",
    "__version__",
]
