"""The SmolLM2 recipe: EAGLE-3 / EAGLE-3.1 drafters for SmolLM2-135M-Instruct, trained here.

* ``build``    the stages (target → prompts → distill → train → evaluate → bundle), budget and CLI;
* ``prompts``  instructions derived from the CPython standard library and general questions;
* ``distill``  SmolLM2's own answers (self-distillation, greedy and sampled).

    python -m tritonspec.recipes.smollm2 --budget-minutes 120
"""

from .build import STAGES, RecipeConfig, main, run

__all__ = ["run", "main", "RecipeConfig", "STAGES"]
