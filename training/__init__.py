"""Drafter training (EAGLE-3 / EAGLE-3.1 training-time test) and the demo-pair recipe.

>>> from tritonspec.training import TrainConfig
>>> TrainConfig(steps=5, fc_norm=False, norm_output=False).ttt_depth
7
"""
from .trainer import TrainConfig, TrainResult, train_drafter
from .ttt import TTTOutput, ttt_forward, ttt_mask

__all__ = ["TrainConfig", "TrainResult", "train_drafter", "ttt_forward", "ttt_mask", "TTTOutput"]
