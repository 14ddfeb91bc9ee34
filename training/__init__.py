"""Drafter training: the trainer (``trainer``), the unrolled training-time test (``ttt``) and the
training data (``data``: loading, self-distillation, the draft vocabulary) and ``evaluate`` (the
demo-pair evaluation). The command line is ``tritonspec train`` (``cli/train.py``).

The recipe that rebuilds the bundled demo pair (corpus, prompt sets, draft LM, the build stages)
lives in ``tritonspec.recipes.demo``.

>>> from tritonspec.training import TrainConfig
>>> TrainConfig(steps=5, fc_norm=False, norm_output=False).ttt_depth
7
"""

from .trainer import TrainConfig, TrainResult, train_drafter, train_drafters
from .ttt import TTTOutput, ttt_forward, ttt_mask

__all__ = ["TrainConfig", "TrainResult", "train_drafter", "train_drafters", "ttt_forward", "ttt_mask", "TTTOutput"]
