"""The demo corpus: the CPython standard library of the installing Python, split by path hash.

Files are listed in a fixed order (sorted relative paths), test suites and site-packages are
left out, and a file is held out for evaluation when ``sha256(relative path) % 100 <
heldout_percent``: the split never depends on the machine, the file's content or a seed.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_PARTS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
EOS = "<|endoftext|>"


@dataclass(frozen=True)
class SourceFile:
    """One corpus file: its path relative to the stdlib root, content hash and split."""

    relpath: str
    sha256: str
    num_bytes: int
    heldout: bool


def stdlib_root() -> Path:
    """The standard-library folder of the running Python (``sysconfig.get_paths()['stdlib']``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str, heldout_percent: int) -> bool:
    """Deterministic split by path hash.

    >>> is_heldout("json/decoder.py", 0)
    False
    """
    return int(hashlib.sha256(relpath.encode()).hexdigest(), 16) % 100 < heldout_percent


def list_corpus(root: Path | None = None, heldout_percent: int = 5) -> list[SourceFile]:
    """All ``*.py`` files under ``root`` (default: the stdlib), sorted, with hashes and split."""
    root = Path(root) if root is not None else stdlib_root()
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if EXCLUDED_PARTS.intersection(rel.split("/")[:-1]):
            continue
        data = p.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a handful of legacy-encoded files; keep the corpus UTF-8
        files.append(SourceFile(rel, hashlib.sha256(data).hexdigest(), len(data), is_heldout(rel, heldout_percent)))
    if not files:
        raise ValueError(f"no *.py files found under {root}: pass the folder of a Python standard library")
    return files


def read_text(root: Path, f: SourceFile) -> str:
    return (Path(root) / f.relpath).read_text(encoding="utf-8")


def train_bpe_tokenizer(texts: list[str], vocab_size: int, directory: Path):
    """Train a byte-level BPE tokenizer and save it (``tokenizer.json`` + config) in ``directory``.

    Returns the ``transformers.PreTrainedTokenizerFast``; ``<|endoftext|>`` (id 0) is EOS.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.save_pretrained(str(directory))
    return fast
