"""tritonspec: EAGLE-3 / EAGLE-3.1 speculative decoding for Hugging Face LLMs.

>>> import tritonspec as ts
>>> ts.SpecConfig.chain(4)
SpecConfig(num_speculative_tokens=4, top_k=1, num_draft_tokens=5)
"""

from .demo import demo_pair
from .drafters import shipped_drafter
from .kernels.store import package_version
from .runtime.config import GenerationOutput, SpecConfig, SpecStats
from .runtime.drafter import DrafterConfig, Eagle3Drafter
from .runtime.engine import SpeculativeRuntime
from .runtime.errors import UserError
from .runtime.target import SUPPORTED_ARCHITECTURES, TargetModel

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
