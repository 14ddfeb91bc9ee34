"""Everyday chat tasks for the SmolLM2 drafters: the request forms a chat user asks beyond code.

The stdlib-derived instructions (``prompts.py``) are nearly all code, and the questions SmolLM2
writes itself (``distill.self_chat_queries``) are mostly "can you help me ..." requests. Chat users
also ask for word problems to be solved, text to be rewritten, short pieces to be written and
things to be explained. ``build_task_prompts`` builds such requests from templates:

* ``math``: word problems and equations with seeded random numbers (rates, percentages,
  proportions, ages, areas, averages, unit conversions, linear equations, probability, time);
* ``rewrite``: a prose paragraph from text on this machine (the Python documentation's topics in
  ``pydoc_data`` and stdlib module docstrings), and a request to summarise, simplify, shorten,
  make formal, turn into bullets, translate, or write questions about it;
* ``write``: a short piece (poem, email, story opening, product description, dialogue, ...) about a
  topic from the lists below;
* ``explain``: how something works, why something happens, or two things compared.

The request types are the common ones of chat-instruction sets, so they are also the benchmark
chat set's types (``perf/prompts/smollm2_chat.jsonl``: word problems, rewrites, writing,
explanations): e.g. both hold a speed-distance-time problem. The wording, the numbers and the topic
lists are written here and avoid the benchmark's topics (``tests/test_recipe_smollm2.py`` checks
that no request shares an 8-word run with a benchmark prompt, nor names one of its topics).
Records are ``{"id": "task.<form>.<i>", "kind": "task", "prompt": [user message]}``.
"""

from __future__ import annotations

import ast
import inspect
import random
import re
import sysconfig
from pathlib import Path

WRITE_FORMS = (
    "Write a short poem about {topic}.",
    "Write a haiku about {topic}.",
    "Write a four-line rhyming poem about {topic}.",
    "Write a short story of about 150 words about {topic}.",
    "Write the opening paragraph of a novel about {topic}.",
    "Write a blog post introduction about {topic}.",
    "Write a short speech for a school assembly about {topic}.",
    "Write a tweet announcing {event}.",
    "Write an invitation to {event}.",
    "Write a friendly email to {person} about {event}.",
    "Write a short apology email to {person} for missing {event}.",
    "Write a product description for {product}.",
    "Write three taglines for {product}.",
    "Write a customer review of {product}.",
    "Write a short dialogue between {person} and {person2} about {topic}.",
    "Write a short motivational message for {person} who is nervous about {milestone}.",
    "Give me five creative names for {business}.",
    "Write a short advertisement for {business}.",
    "Write a job posting for {job} at {business}.",
    "Write a short, fictional biography of {job}.",
    "Write a diary entry of {job} after a long day.",
    "Write a children's bedtime story about {animal}.",
    "Write a riddle about {thing}.",
    "Write a list of ten fun facts a child might enjoy about {animal}.",
)
EXPLAIN_FORMS = (
    "How does {thing} work?",
    "Explain how {thing} works in simple terms.",
    "Explain {concept} to a beginner.",
    "What is {concept}? Give an example.",
    "Explain {concept} in three short paragraphs.",
    "What are the pros and cons of {choice}?",
    "Give me five tips for {activity}.",
    "What should I know before {activity}?",
    "What mistakes do beginners make when {activity}?",
    "Make a one-week plan for {activity}.",
    "What is the difference between {pair}?",
    "Compare {pair} in a short table.",
    "What is the history of {invention}, in brief?",
    "Why is {concept} important?",
)
REWRITE_FORMS = (
    "Summarize this text in two sentences:\n\n{text}",
    "Summarize this text in one sentence:\n\n{text}",
    "Rewrite this text so that a twelve-year-old can understand it:\n\n{text}",
    "Rewrite this text in a more formal tone:\n\n{text}",
    "Rewrite this text in a friendly, casual tone:\n\n{text}",
    "Shorten this text to about half its length:\n\n{text}",
    "Turn this text into a bulleted list of its main points:\n\n{text}",
    "Translate this text into Spanish:\n\n{text}",
    "Translate this text into German:\n\n{text}",
    "Write three quiz questions, with answers, about this text:\n\n{text}",
    "What are the key terms in this text? Define each one briefly:\n\n{text}",
    "Give this text a title and a one-line subtitle:\n\n{text}",
)
# a module's docstring: the first statement, after comments and blank lines (no parse of the whole file)
MODULE_DOC = re.compile(r'(?:[ \t]*(?:#[^\n]*)?\n)*[rRuU]?("""|\'\'\')(.*?)\1', re.DOTALL)
# fmt: off
TOPICS = (
    "a rainy morning in the city", "an old clockmaker's last night", "friendship", "learning to ride a bike",
    "a forgotten garden", "the first snow of winter", "a long train journey", "moving to a new country",
    "a street market at dusk", "a robot who wants to be a chef", "the smell of fresh bread", "a lost umbrella",
    "a mountain village", "the night sky in the desert", "a grandmother's recipe book", "a library after closing time",
    "a summer thunderstorm", "the last day of school", "a jazz musician", "a small boat on a big lake",
    "a time traveller stuck in 1920", "an abandoned amusement park", "a city that never sleeps", "a quiet Sunday",
    "kindness between strangers", "a dragon afraid of the dark", "the sound of the sea", "hope after a hard year",
    "a bakery on the corner", "a message in a bottle", "coffee", "spring flowers", "a broken clock", "the moon",
    "a football match in the rain", "an astronaut's first day in space", "a family road trip", "a secret door",
)
EVENTS = (
    "our team's summer picnic", "the opening of a new community garden", "a charity run next month",
    "my sister's graduation party", "a book club meeting on Thursday", "the launch of our new website",
    "a neighbourhood clean-up day", "a farewell lunch for a colleague", "a board game night",
    "a piano recital", "the annual science fair", "a wedding anniversary dinner", "a volunteer training session",
    "a hackathon this weekend", "a school reunion",
)
MILESTONES = (
    "a job interview", "a driving test", "the first day at a new job", "a final exam", "a first marathon",
    "giving a wedding toast", "a dentist appointment", "moving abroad", "a big presentation at work",
)
INVENTIONS = (
    "the bicycle", "the printing press", "paper money", "the telephone", "the light bulb", "the compass",
    "the steam engine", "photography", "the refrigerator", "the internet", "the microscope", "the calendar",
    "the sewing machine", "the radio", "eyeglasses", "the postal service", "the elevator", "chocolate bars",
)
PEOPLE = (
    "a colleague", "my manager", "a neighbour", "an old friend", "my teacher", "a new team member", "my cousin",
    "a shop owner", "a doctor", "a student", "a grandparent", "a travel agent", "a detective",
)
PRODUCTS = (
    "a solar-powered phone charger", "a bamboo toothbrush", "a smart plant pot that waters itself",
    "a quiet mechanical keyboard", "a foldable electric scooter", "handmade soy candles", "a travel pillow",
    "a recipe app for busy parents", "wireless earbuds for runners", "an ergonomic office chair", "organic green tea",
    "a language-learning board game", "a waterproof hiking backpack", "a kitchen scale with a timer", "a desk lamp",
)
BUSINESSES = (
    "a vegan food truck", "a dog-walking service", "a small bookshop", "a yoga studio", "a ceramics studio",
    "a tutoring service", "an online plant store", "a family-run bakery", "a photography studio", "a cleaning company",
    "a coffee roastery", "a second-hand clothing store", "a local gym", "a pet grooming salon", "a craft brewery",
)
JOBS = (
    "a nurse", "a software developer", "a firefighter", "a chef", "a librarian", "a farmer", "a pilot",
    "an electrician", "a graphic designer", "a marine biologist", "a bus driver", "an architect", "a veterinarian",
    "a translator", "a carpenter",
)
ANIMALS = (
    "a curious fox", "a sleepy panda", "an octopus", "a brave little mouse", "penguins", "a lonely whale", "honeybees",
    "an owl who cannot sleep", "a giraffe", "dolphins", "a turtle who wants to fly", "elephants",
)
THINGS = (
    "a microwave oven", "a bicycle gear system", "a solar panel", "an electric car battery", "a compass",
    "a smoke detector", "a touchscreen", "GPS navigation", "a hot-air balloon", "a dishwasher", "a vaccine trial",
    "a thermostat", "a camera lens", "an elevator", "a lock and key", "Wi-Fi", "a heat pump", "a barcode scanner",
    "an airplane wing", "a washing machine", "a search engine", "a wind turbine", "3D printing", "a pendulum clock",
    "the printing press", "paper money", "the telephone", "a submarine", "a rainbow", "an earthquake",
)
CONCEPTS = (
    "supply and demand", "the scientific method", "opportunity cost", "a budget", "the food chain", "evolution",
    "gravity", "democracy", "renewable energy", "the immune system", "recycling", "a stock market index",
    "probability", "inertia", "the greenhouse effect", "biodiversity", "critical thinking", "a mortgage",
    "time management", "active listening", "photosynthesis in plants", "the metric system", "electric current",
    "a healthy diet", "copyright", "a carbon footprint", "mindfulness", "erosion", "the placebo effect",
)
CHOICES = (
    "working from home", "renting versus buying a home", "electric cars", "learning a second language as an adult",
    "studying abroad", "a four-day work week", "online classes", "owning a dog", "living in a big city",
    "buying a used car", "freelancing", "public transport", "meal prepping", "social media for small businesses",
)
ACTIVITIES = (
    "running", "learning to cook", "saving money", "learning to draw", "public speaking",
    "growing vegetables on a balcony", "studying for exams", "travelling on a budget", "learning to swim",
    "starting a small business", "writing a novel", "keeping a journal", "learning the drums",
    "hiking in the mountains", "making new friends in a new city", "taking better photos with a phone",
    "reducing screen time", "baking bread",
)
PAIRS = (
    "a lake and a pond", "a frog and a toad", "a meteor and a meteorite", "weather forecasting and astrology",
    "a debit card and a credit card", "an emulsion and a solution", "a hurricane and a tornado",
    "baking soda and baking powder", "a republic and a monarchy", "a simile and a metaphor", "an ape and a monkey",
    "a cold and the flu", "speed and velocity", "a vegan and a vegetarian diet", "a novel and a novella",
    "a moth and a butterfly", "mass and weight", "an astronomer and an astrologer", "a violin and a viola",
    "a symphony and a concerto",
)
NAMES = (
    "Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena", "Mo", "Nia",
)
ITEMS = (
    "pencils", "stickers", "apples", "books", "cards", "shells", "coins", "stamps", "buttons", "tickets",
)
# fmt: on


def _math(rng: random.Random) -> str:
    """One word problem with seeded numbers (12 forms)."""
    a, b = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    k = rng.randrange(12)
    if k == 0:
        d, v = rng.choice((120, 150, 180, 210, 300, 360)), rng.choice((40, 45, 60, 90))
        return (
            f"A bus travels {d} km at an average speed of {v} km/h. How long does the trip take, in hours and minutes?"
        )
    if k == 1:
        p, q = rng.choice((20, 35, 48, 60, 80, 120)), rng.choice((10, 15, 20, 30, 40))
        return f"A jacket costs ${p}. The price goes up by {q}%. What is the new price?"
    if k == 2:
        n, m, t = rng.randint(2, 5), rng.randint(2, 6), 2 * rng.randint(12, 45)
        return (
            f"{a} has {n} times as many {item} as {b}, and {b} has {m} more than half of {t}. "
            f"How many {item} does {a} have?"
        )
    if k == 3:
        w, extra = rng.randint(3, 15), rng.randint(2, 9)
        return f"A garden is {w} m wide and {extra} m longer than it is wide. What are its area and its perimeter?"
    if k == 4:
        xs = [rng.randint(50, 100) for _ in range(rng.randint(3, 6))]
        return f"{a} scored {', '.join(map(str, xs[:-1]))} and {xs[-1]} on tests. What is the average score?"
    if k == 5:
        x, c, m = rng.randint(2, 12), rng.randint(1, 9), rng.randint(2, 7)
        return f"Solve for y: {m}y + {c} = {m * x + c}. Explain each step."
    if k == 6:
        r, s = rng.choice((2, 3, 4)), rng.randint(2, 6)
        return (
            f"A jar holds {r} red and {s} blue marbles. "
            f"If I draw two without putting the first back, what is the probability both are blue?"
        )
    if k == 7:
        h, mins, dur = rng.randint(6, 20), rng.choice((0, 10, 25, 40, 55)), rng.randint(70, 400)
        return f"A film starts at {h}:{mins:02d} and lasts {dur} minutes. When does it end?"
    if k == 8:
        cups, people, target = rng.randint(2, 4), rng.choice((4, 6, 8)), rng.choice((10, 12, 18, 20))
        return (
            f"A soup recipe for {people} people needs {cups} cups of broth. "
            f"How much broth is needed for {target} people?"
        )
    if k == 9:
        miles = rng.randint(5, 60)
        return f"How many kilometres are {miles} miles? And how many metres is that?"
    if k == 10:
        age, diff, yrs = rng.randint(5, 15), rng.randint(20, 35), rng.randint(3, 12)
        return (
            f"{a} is {age} and their mother is {diff} years older. "
            f"In {yrs} years, how old will each be, and what will the ratio of their ages be?"
        )
    wage, hours = rng.choice((12, 15, 18, 22, 25)), rng.randint(10, 40)
    return (
        f"{a} earns ${wage} an hour and works {hours} hours a week. "
        f"How much is that in a month of four weeks, and in a year?"
    )


def prose_paragraphs(root: Path | None = None, min_words: int = 35, max_words: int = 110) -> list[str]:
    """English paragraphs of ``min_words``-``max_words`` words from this Python's documentation topics
    (``pydoc_data/topics.py``) and stdlib module docstrings, reST markup stripped."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    topics = root / "pydoc_data" / "topics.py"
    if topics.exists():
        try:
            tree = ast.parse(topics.read_text(encoding="utf-8"))
            texts += [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        except (SyntaxError, UnicodeDecodeError, ValueError):
            pass
    for path in sorted(root.glob("*.py")):
        try:
            m = MODULE_DOC.match(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if m:
            texts.append(inspect.cleandoc(m.group(2)))
    out = []
    for text in texts:
        for para in re.split(r"\n\s*\n", text):
            if para.startswith((" ", "\t")) or ">>>" in para or "::" in para or "|" in para:
                continue  # code, tables and grammar rules
            p = re.sub(r"\*+|`+|\s+", lambda m: " " if m.group().isspace() else "", para).strip()
            words = p.split()
            symbols = sum(not (c.isalnum() or c.isspace() or c in ".,;:'()-\"’!?") for c in p)
            if symbols > 0.01 * len(p):
                continue  # code-like: paths, escapes, braces
            if min_words <= len(words) <= max_words and p.endswith(".") and p[:1].isupper():
                out.append(p)
    return sorted(set(out))


def build_task_prompts(n: int, seed: int = 0, root: Path | None = None) -> list[dict]:
    """``n`` everyday chat requests (module docstring), the four forms in rotation, seeded; a
    ``ValueError`` when the templates give fewer distinct ones. Each prose paragraph is rewritten
    once before any is reused.

    Examples
    --------
    >>> recs = build_task_prompts(4, seed=1)
    >>> [r["id"].split(".")[1] for r in recs], recs[0]["kind"]
    (['math', 'rewrite', 'write', 'explain'], 'task')
    """
    rng = random.Random(seed)
    paragraphs = prose_paragraphs(root)
    rng.shuffle(paragraphs)
    out: list[dict] = []
    seen: set[str] = set()
    forms = ("math", "rewrite", "write", "explain")
    tries = n_rewrites = 0
    while len(out) < n and tries < 20 * n + 100:
        tries += 1
        form = forms[len(out) % len(forms)]
        if form == "math":
            text = _math(rng)
        elif form == "rewrite":
            if not paragraphs:
                raise ValueError(
                    "no prose paragraphs found for rewrite requests (pydoc_data/topics.py, stdlib docstrings)"
                )
            # each paragraph once (in a seeded order) until all are used: a held-out rewrite's text
            # is then no training rewrite's
            text = rng.choice(REWRITE_FORMS).format(text=paragraphs[n_rewrites % len(paragraphs)])
            n_rewrites += 1
        elif form == "write":
            p1, p2 = rng.sample(PEOPLE, 2)
            text = rng.choice(WRITE_FORMS).format(
                topic=rng.choice(TOPICS), event=rng.choice(EVENTS), milestone=rng.choice(MILESTONES), person=p1,
                person2=p2, product=rng.choice(PRODUCTS), business=rng.choice(BUSINESSES), job=rng.choice(JOBS),
                animal=rng.choice(ANIMALS), thing=rng.choice(THINGS),
            )  # fmt: skip
        else:
            text = rng.choice(EXPLAIN_FORMS).format(
                thing=rng.choice(THINGS), concept=rng.choice(CONCEPTS), choice=rng.choice(CHOICES),
                activity=rng.choice(ACTIVITIES), pair=rng.choice(PAIRS), invention=rng.choice(INVENTIONS),
            )  # fmt: skip
        if text in seen:
            continue
        seen.add(text)
        out.append({"id": f"task.{form}.{len(out)}", "kind": "task", "prompt": [{"role": "user", "content": text}]})
    if len(out) < n:
        raise ValueError(f"n_tasks={n}: the templates give {len(out)} distinct requests; ask for at most that many")
    return out
