"""Training instructions for the SmolLM2 drafters, derived from text on this machine.

Sources (never HumanEval, never the benchmark prompt sets in ``perf/``):

* CPython standard-library functions that have a docstring, turned into four kinds of request:
  ``complete`` (the signature and docstring as raw code, the model writes the body: the form of
  code-completion benchmarks), ``write`` (a chat request for the function from its first
  docstring sentence), ``explain`` (a chat request to explain the source) and ``fix`` (the source
  with one operator flipped, and a request to find the bug);
* general questions: stdlib module summaries as topics, asked with a handful of question forms;
* long-context requests (``build_long_prompts``): a whole stdlib module's source (cut to at most
  ``LONG_MAX_CHARS`` at a line end, ~2K tokens) pasted into a chat message, then a question about
  it, in the form of the benchmark's long set but never about its modules (``LONG_EXCLUDED``; their
  functions can still appear in the requests above).

Every record is ``{"id", "kind", "prompt"}`` where ``prompt`` is a raw string (``complete``) or a
list of chat messages. The selection is seeded and spread over files by a hash of the path.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

KINDS = ("complete", "write", "explain", "fix")
MAX_SOURCE_LINES = 40
# operator flips for "fix" requests: (pattern, replacement), applied once to a line of the body
BUGS = (
    (r" == ", " != "),
    (r" != ", " == "),
    (r" < ", " <= "),
    (r" > ", " >= "),
    (r" \+ 1\b", " - 1"),
    (r" - 1\b", " + 1"),
    (r"\bnot ", ""),
    (r" and ", " or "),
    (r" or ", " and "),
    (r"\bTrue\b", "False"),
)
QUESTION_FORMS = (
    "What is the Python `{name}` module used for? Give a short example.",
    "Explain {topic} to a beginner.",
    "When should I use the `{name}` module in Python, and what are its main functions?",
    "Write a short tutorial on {topic}.",
    "What are common mistakes when working with {topic}?",
    "Summarize {topic} in three bullet points.",
)
GENERAL = (
    "How does a hash table handle collisions?",
    "What is the difference between a process and a thread?",
    "Explain recursion with an example.",
    "What is Big-O notation?",
    "How do I read a CSV file in Python?",
    "What is the difference between a list and a tuple in Python?",
    "Explain what a REST API is.",
    "How does garbage collection work in Python?",
    "What is a decorator in Python?",
    "Give me tips for writing clean code.",
    "What causes a stack overflow?",
    "Explain the difference between TCP and UDP.",
    "What is a binary search tree?",
    "How do I sort a dictionary by value in Python?",
    "What is the difference between `is` and `==` in Python?",
    "Explain list comprehensions.",
    "What is unit testing and why does it matter?",
    "How does HTTPS keep data private?",
    "What is a virtual environment in Python?",
    "Explain the map, filter and reduce functions.",
    "What is dynamic programming?",
    "How can I make a Python script faster?",
    "What is the GIL in Python?",
    "Explain how git branches work.",
    "What is the difference between SQL and NoSQL databases?",
    "Write a haiku about programming.",
    "Give three ideas for a weekend project to learn Python.",
    "What is machine learning, in simple words?",
    "How do I handle exceptions in Python?",
    "What are generators in Python and why are they useful?",
    "Why is the sky blue?",
    "How do plants make food?",
    "What are the benefits of regular exercise?",
    "Give me a simple recipe for pancakes.",
    "How do vaccines work?",
    "What is the water cycle?",
    "Explain inflation in simple terms.",
    "How can I improve my sleep?",
    "What is photosynthesis?",
    "Write a short story about a robot learning to paint.",
)


LONG_MIN_CHARS = 5000  # a long-context prompt's module source: ~1.2K-2.3K SmolLM2 tokens
LONG_MAX_CHARS = 9000
# the modules of perf/prompts/smollm2_long{,_tune}.jsonl (benchmark and tuning sets): never trained on
LONG_EXCLUDED = ("graphlib", "filecmp", "copy", "glob", "getopt", "shelve", "queue", "netrc", "numbers")
LONG_QUESTIONS = (
    "Explain what the function `{func}` in this module does and when a caller would use it.",
    "List the public functions and classes of this module with a one-line description of each.",
    "Write a short example program that uses `{func}` from this module.",
    "Summarize what this module is for in one paragraph, then name its three most important functions.",
    "Write unit tests with the unittest module for `{func}`.",
    "Are there edge cases or possible bugs in `{func}`? Explain each one.",
    "How does the class `{cls}` work? Describe its main methods.",
)


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's top-level and package ``*.py`` files (tests and idlelib excluded)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__")
    return sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))


def _functions(path: Path) -> Iterator[tuple[str, str, str, str]]:
    """(name, header, docstring, source) of the module-level functions and methods with a docstring."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    lines = text.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < 40 or not node.body or node.end_lineno is None:
            continue
        first = node.body[0]
        src = lines[node.lineno - 1 : node.end_lineno]
        if node.decorator_list or len(src) > MAX_SOURCE_LINES or len(src) < 4:
            continue
        indent = len(src[0]) - len(src[0].lstrip())
        src = [ln[indent:] for ln in src]
        header = "\n".join(src[: first.end_lineno - node.lineno + 1]) + "\n"
        yield node.name, header, doc, "\n".join(src) + "\n"


def _first_sentence(doc: str) -> str:
    para = doc.strip().split("\n\n")[0].replace("\n", " ")
    para = re.sub(r"\s+", " ", para)
    return para.split(". ")[0].rstrip(".") + "."


def _with_bug(source: str, rng: random.Random) -> str | None:
    lines = source.splitlines()
    body = [i for i, ln in enumerate(lines) if i > 0 and not ln.strip().startswith(("#", '"', "'"))]
    rng.shuffle(body)
    for i in body:
        for pat, rep in rng.sample(BUGS, len(BUGS)):
            new, n = re.subn(pat, rep, lines[i], count=1)
            if n:
                return "\n".join(lines[:i] + [new] + lines[i + 1 :]) + "\n"
    return None


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def build_prompts(n_code: int = 1200, n_general: int = 300, seed: int = 0, root: Path | None = None) -> list[dict]:
    """``n_code`` requests from stdlib functions (kinds in rotation) and ``n_general`` questions."""
    rng = random.Random(seed)
    funcs = []
    for path in stdlib_files(root):
        key = int(hashlib.sha256(str(path.name).encode()).hexdigest()[:8], 16)
        funcs.extend((key, path.stem, *f) for f in _functions(path))
    rng.shuffle(funcs)
    out: list[dict] = []
    for k, (_, module, name, header, doc, source) in enumerate(funcs):
        if sum(r["kind"] in KINDS for r in out) >= n_code:
            break
        kind = KINDS[k % len(KINDS)]
        sig = header.splitlines()[0].removeprefix("def ").removeprefix("async def ").rstrip(":")
        if kind == "complete":
            prompt: str | list[dict] = header
        elif kind == "write":
            prompt = _chat(f"Write a Python function `{sig}`. {_first_sentence(doc)}")
        elif kind == "explain":
            prompt = _chat(f"Explain what this Python function does:\n```python\n{source}```")
        else:
            bad = _with_bug(source, rng)
            if bad is None:
                continue
            prompt = _chat(f"This Python function has a bug. Find it and show the fixed code:\n```python\n{bad}```")
        out.append({"id": f"{module}.{name}.{kind}", "kind": kind, "prompt": prompt})
    modules = sorted({p.stem for p in stdlib_files(root) if not p.stem.startswith("_") and p.stem != "__init__"})
    general = [_chat(q) for q in GENERAL]
    asked: set[tuple[str, str]] = set()
    while len(general) < n_general and len(asked) < len(modules) * len(QUESTION_FORMS):
        # one pass over the modules in a seeded order, another pass if more are asked for
        for name in rng.sample(modules, min(len(modules), n_general - len(general))):
            form = rng.choice([f for f in QUESTION_FORMS if (name, f) not in asked] or QUESTION_FORMS)
            if (name, form) not in asked:
                asked.add((name, form))
                general.append(_chat(form.format(name=name, topic=f"the Python {name} module")))
    for i, msgs in enumerate(general[:n_general]):
        out.append({"id": f"general.{i}", "kind": "general", "prompt": msgs})
    return out


def _public_names(text: str, lines: int) -> tuple[list[str], list[str]]:
    """Public module-level function and class names of a module's whole source (``ast``) that end
    within its first ``lines`` lines (the pasted part: a cut text seldom parses on its own)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return [], []
    shown = [n for n in tree.body if n.end_lineno is not None and n.end_lineno <= lines]
    funcs = [n.name for n in shown if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    classes = [n.name for n in shown if isinstance(n, ast.ClassDef)]
    return [f for f in funcs if not f.startswith("_")], [c for c in classes if not c.startswith("_")]


def build_long_prompts(n_long: int, seed: int = 0, root: Path | None = None) -> list[dict]:
    """``n_long`` long-context requests: a stdlib module's source (at least ``LONG_MIN_CHARS``, cut to
    ``LONG_MAX_CHARS`` at a line end) and a question about it (``LONG_QUESTIONS``, naming one of its
    public functions or classes), one question per module in a seeded order, then another round.
    The modules of the long benchmark and tuning sets (``LONG_EXCLUDED``) are never used.

    Records are ``{"id": "long.<module>.<form>", "kind": "long", "prompt": [user message]}``.

    Examples
    --------
    >>> recs = build_long_prompts(3, seed=1)
    >>> [r["kind"] for r in recs], recs[0]["prompt"][0]["content"].startswith("Here is the source")
    (['long', 'long', 'long'], True)
    """
    rng = random.Random(seed)
    docs = []
    for path in stdlib_files(root):
        if path.stem in LONG_EXCLUDED or path.stem == "__init__":
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < LONG_MIN_CHARS:
            continue
        shown = text[: text.rindex("\n", 0, LONG_MAX_CHARS) + 1] if len(text) > LONG_MAX_CHARS else text
        funcs, classes = _public_names(text, shown.count("\n"))
        if funcs or classes:
            docs.append((path.stem, shown, funcs, classes))
    rng.shuffle(docs)
    out: list[dict] = []
    asked: set[tuple[str, int]] = set()
    while len(out) < n_long:
        before = len(out)
        for stem, text, funcs, classes in docs:
            if len(out) >= n_long:
                break
            forms = [
                k
                for k, q in enumerate(LONG_QUESTIONS)
                if (stem, k) not in asked and ("{func}" not in q or funcs) and ("{cls}" not in q or classes)
            ]
            if not forms:
                continue
            k = rng.choice(forms)
            asked.add((stem, k))
            q = LONG_QUESTIONS[k].format(func=rng.choice(funcs or [""]), cls=rng.choice(classes or [""]))
            content = f"Here is the source of the Python module `{stem}.py`:\n\n```python\n{text}```\n\n{q}"
            out.append({"id": f"long.{stem}.{k}", "kind": "long", "prompt": _chat(content)})
        if len(out) == before:  # every (module, question) pair asked
            break
    return out
