"""Reading and writing weight files (safetensors, sharded safetensors, pytorch_model.bin)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from .errors import UserError


def load_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face model directory, with errors that name the file."""
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"model directory {str(d)!r} does not exist")
    single = d / "model.safetensors"
    index = d / "model.safetensors.index.json"
    binary = d / "pytorch_model.bin"
    if single.exists():
        return _read_safetensors(single)
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as e:
            raise UserError(f"corrupt weight index {index}: {e}") from e
        out: dict[str, torch.Tensor] = {}
        for shard in shards:
            path = d / shard
            if not path.exists():
                raise FileNotFoundError(f"weight shard {path} named in {index.name} is missing")
            out.update(_read_safetensors(path))
        return out
    if binary.exists():
        try:
            return torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
            raise UserError(f"corrupt weight file {binary}: {e}") from e
    raise FileNotFoundError(
        f"no weights in {d}: expected model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    )


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises several error types
        raise UserError(f"corrupt weight file {path}: {e}") from e


def read_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: is {str(directory)!r} a Hugging Face model directory?")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise UserError(f"corrupt config file {path}: {e}") from e


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a model directory, or None when it has none (a warning when it fails to load)."""
    path = Path(path)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"could not load the tokenizer in {path}: {e}; texts will be None", stacklevel=3)
        return None
