"""The demo-pair recipe: rebuilds ``tritonspec/demo/`` from the CPython standard library.

* ``build``        the stages (corpus → target → prompts → drafters → bundle), budgets, ``run`` and the CLI;
* ``corpus``       the stdlib file list, the held-out split by path hash, the BPE tokenizer;
* ``prompt_sets``  the ``standard`` / ``long`` / ``perturbed`` evaluation sets from held-out files;
* ``draft_lm``     the 2-layer draft LM for transformers' assisted generation (``demo/draft-lm``).

    python -m tritonspec.recipes.demo --out <package>/demo --budget bundled
    python -m tritonspec.recipes.demo.draft_lm --work <package>/.demo-work --out <package>/demo/draft-lm
"""

from .build import BUDGETS, STAGES, RecipeConfig, main, run

__all__ = ["run", "main", "RecipeConfig", "BUDGETS", "STAGES"]
