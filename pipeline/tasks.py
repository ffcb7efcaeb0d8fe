"""Synthetic long-context tasks after RULER (Hsieh et al., 2024), on Jane Austen's prose, sized in model tokens.

    nkv tasks --out suite.parquet [--size quick|small|standard] [--model smollm2-135m]

Every document is one task at one target length (tokens of the model's tokenizer, counted by a function the
caller passes in), with several questions, so one compressed context answers many. The tasks follow RULER's
published definitions, written afresh here; needles sit at sentence boundaries of consecutive Austen text:

- ``niah_single``: three needles of different kinds (a number, a code word, a name), each under its own key;
  one question per needle.
- ``niah_multikey``: four needles of one kind and one phrasing under four keys; one question per key, the
  other three are distractors of the same kind.
- ``niah_multivalue``: two keys with four values each; "what are all the values of key k" (all four).
- ``niah_multiquery``: four keys, one value each; each question asks for two keys' values at once.
- ``variable_tracking``: two chains of five variables (``VAR A = 12345``, ``VAR B = VAR A``, ...); "which
  variables hold 12345" (all five of that chain).
- ``common_words``: a numbered list of words drawn from the novels' vocabulary, ten of them 30 times each
  (fewer when the length cannot hold 300 entries, always more than the others), the others 3 times; "the ten
  most common words". No prose, as in RULER.
- ``two_hop``: two chains "A is in B" ... "B is in C"; "in which C is A" (the second hop's answer).

``summary_documents`` gives plain text of a length (no needles, no questions) for comparing summaries.

Surface forms (key words, value nouns, statement and question phrasings, names) are drawn per document, so
no press wins by a template. Numbers have five digits (RULER: seven) so that a four-value answer fits in 32
new tokens. A question's gold ``answers`` entry is its ``parts`` joined by ", "; RULER's score (and the
suite's ``recall``) is the share of ``parts`` found in the answer. Output: Parquet in the pipeline's input
schema plus ``task``, ``length`` (target tokens), ``n_tokens`` (measured), and per question ``kinds``,
``parts`` and ``evidence`` (the planted sentences that answer it).

Deterministic: every document draws from its own RNG seeded by (seed, task, length, index), so a subset of
tasks or lengths yields the same documents as the full set.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

TokenCounter = Callable[[str], int]

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking", "common_words",
         "two_hop")
DATA = Path(__file__).resolve().parents[1] / "data"
DEFAULT_AUSTEN = Path(__file__).resolve().parents[2] / "shared/data/austen"
NOVEL_FILES = ("prideprejudice.txt", "sensesensibility.txt", "northangerabbey.txt", "mansfieldpark.txt")


@dataclass(frozen=True)
class Size:
    lengths: tuple[int, ...]  # target context tokens
    per_task: int  # documents per task and length


SIZES = {
    "quick": Size((1024,), 1),
    "small": Size((2048,), 2),
    # 8k documents leave 256 tokens of SmolLM2's 8,192 window for the chat template, question and answer.
    "standard": Size((2048, 4096, 7936), 2),
}

# -- Austen's text: chapters -> paragraphs -> sentences ------------------------------------------------------
ABBREVIATIONS = {"Mr.", "Mrs.", "Dr.", "St.", "Col.", "Capt.", "Esq."}
SENTENCE_END = re.compile(r'(?<=[.!?]) +(?=["A-Z])')


def roman(s: str) -> int:
    if s.isdigit():
        return int(s)
    vals = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100}
    nums = [vals[c] for c in s.upper()]
    return sum(-n if n < nxt else n for n, nxt in zip(nums, nums[1:] + [0]))


def read_chapters(path: Path) -> dict[int, list[str]]:
    """Chapter number -> paragraphs (blank lines separate paragraphs; wrapped lines are joined with spaces)."""
    chapters: dict[int, list[str]] = {}
    current = None
    for block in re.split(r"\n\s*\n", path.read_text(encoding="utf-8")):
        para = " ".join(block.split())
        m = re.fullmatch(r"chapter\s+([0-9]+|[ivxlc]+)\.?", para, re.I)
        if m:
            current = chapters.setdefault(roman(m.group(1)), [])
        elif para in ("THE END", "A NOTE ON THE TEXT"):
            current = None  # end matter, not Austen's text
        elif current is not None and para and para[0] not in "[*":  # editorial notes and footnotes
            current.append(re.sub(r"_([^_]+)_", r"\1", para))  # underscores mark italics
    return chapters


def boundaries(paras: list[str]) -> list[tuple[int, int]]:
    """(paragraph, offset) where a new sentence may go: a paragraph start, or after a sentence, outside quotes."""
    out, open_quote = [], False
    for i, p in enumerate(paras):
        if i == 0 or (not open_quote and paras[i - 1][-1] in '.!?"'):  # not after "... said in reply:"
            out.append((i, 0))
        # A quotation over several paragraphs reopens each one with '"' and closes only at its end.
        open_quote = open_quote and not p.startswith('"')
        for m in SENTENCE_END.finditer(p):
            before = p[:m.start()]
            if (open_quote + before.count('"')) % 2 == 0 and before.rsplit(" ", 1)[-1] not in ABBREVIATIONS:
                out.append((i, m.start()))
        open_quote = (open_quote + p.count('"')) % 2 == 1
    return out


@dataclass(frozen=True)
class Sentence:
    para: int  # paragraph number in the haystack
    text: str
    open: bool  # a new sentence may be planted just before this one


def haystack(austen: Optional[Path] = None) -> list[Sentence]:
    """The novels' text as sentences, from ``austen`` (default: the shared copy of the novels when present,
    else the chapters bundled in data/*.parquet with their planted facts removed)."""
    folder = Path(austen) if austen is not None else DEFAULT_AUSTEN
    if all((folder / f).is_file() for f in NOVEL_FILES):
        paras = [p for f in NOVEL_FILES for _, ch in sorted(read_chapters(folder / f).items()) for p in ch]
    elif austen is not None:
        raise FileNotFoundError(f"Austen novels not found in {folder} (need {', '.join(NOVEL_FILES)})")
    else:
        paras = _bundled_paragraphs()
    out: list[Sentence] = []
    spots: dict[int, set[int]] = {}
    for i, off in boundaries(paras):
        spots.setdefault(i, set()).add(off)
    for i, p in enumerate(paras):
        mine = spots.get(i, set())
        cuts = sorted({0, len(p)} | mine)
        for a, b in zip(cuts, cuts[1:]):
            piece = p[a:b].strip()
            if piece:
                out.append(Sentence(i, piece, a in mine))
    return out


def _bundled_paragraphs() -> list[str]:
    paras = []
    for name in ("eval_set", "sample_batch"):
        for r in pq.read_table(DATA / f"{name}.parquet", columns=["text", "answers"]).to_pylist():
            for p in r["text"].split("\n\n"):
                # drop the planted sentences: only Austen's own text may be a haystack
                kept = [s for s in SENTENCE_END.split(p) if not any(a in s for a in r["answers"])]
                if kept:
                    paras.append(" ".join(kept))
    return paras


# -- surface forms -------------------------------------------------------------------------------------------
KEY_ADJ = ["silent", "crimson", "hollow", "amber", "frosty", "gentle", "rusty", "velvet", "distant", "bitter",
           "golden", "narrow", "quiet", "restless", "shining", "tidy", "wild", "wooden", "lofty", "sombre"]
KEY_NOUN = ["lantern", "meadow", "harbour", "thimble", "saddle", "orchard", "kettle", "compass", "ribbon", "anchor",
            "pigeon", "cellar", "mitten", "ladder", "fountain", "barrel", "spindle", "chimney", "bridle", "acorn"]
NOUNS = {
    "number": ["special magic number", "secret number", "lucky number", "ledger number", "cipher number"],
    "word": ["special magic word", "password", "code word", "secret word", "watchword"],
    "name": ["secret correspondent", "chosen heir", "special guest", "appointed trustee", "mystery visitor"],
}
CODE_WORDS = ["quasar", "zeppelin", "tungsten", "mongoose", "saxophone", "kayak", "origami", "tundra", "bazooka",
              "yogurt", "cobalt", "walrus", "nebula", "jaguar", "banjo", "cactus", "igloo", "paprika", "tornado",
              "vortex", "pixel", "gazelle", "lagoon", "bamboo", "cobra", "papaya", "galaxy", "koala", "mango",
              "pelican", "quinoa", "safari", "tofu", "ukulele", "wombat", "zucchini", "marimba", "platypus"]
FIRST = ["Ottoline", "Peregrine", "Cressida", "Thaddeus", "Griselda", "Lysander", "Philippa", "Crispin", "Leopoldine",
         "Ambrosine", "Barnabas", "Euphemia", "Hippolyta", "Ignatius", "Perpetua", "Valentine", "Seraphina", "Evander"]
LAST = ["Farquharson", "Quillfeather", "Thistlewood", "Marchbanks", "Ravensworth", "Dunstaple", "Kettleburn",
        "Wolverstone", "Pennycuick", "Haverbrook", "Blackadder", "Tumbleton", "Grimsditch", "Ashenhurst"]
# One value per key; the phrasing is drawn per document.
STATEMENTS = ["The {noun} for {key} is {value}.", "Remember this: the {noun} of {key} is {value}.",
              "It is written that the {noun} belonging to {key} is {value}.",
              "Note that {key} has {value} as its {noun}."]
QUESTIONS = ["What is the {noun} for {key}?", "What is the {noun} of {key}?", "Which {noun} belongs to {key}?"]
MULTI_STATEMENTS = ["One of the {noun}s for {key} is {value}.", "Among the {noun}s of {key} is {value}.",
                    "A {noun} for {key} is {value}."]
MULTI_QUESTIONS = ["What are all the {noun}s for {key}? List every one.", "List all the {noun}s of {key}."]
QUERY_QUESTIONS = ["What are the {noun}s for {key} and {key2}?", "Give the {noun} of {key} and the {noun} of {key2}."]
VT_FORMS = [("VAR {a} = {v}.", "VAR {a} = VAR {b}."), ("Let {a} be {v}.", "Let {a} be {b}."),
            ("{a} := {v}.", "{a} := {b}.")]
VT_QUESTIONS = ["Find all variables that are assigned the value {v} in the text above.",
                "Which variables hold the value {v}? List them all."]
CWE_QUESTIONS = ["What are the {n} most common words in the list above?",
                 "Which {n} words appear most often in the numbered list above?"]
TWO_HOP = [  # (first hop, second hop, question); A, B, C are drawn from the pools below
    ("The {a} was put away in the {b}.", "The {b} stands in the {c}.", "In which room is the {a}?"),
    ("The {a} is kept inside the {b}.", "The {b} was carried to the {c}.", "In which room is the {a} now?"),
    ("{a} lives in the town of {b}.", "The town of {b} lies in {c}.", "In which county does {a} live?"),
    ("{a} has settled at {b}.", "{b} is a market town in {c}.", "In which county has {a} settled?"),
]
ITEMS = ["silver thimble", "brass key", "pearl brooch", "ivory fan", "sealed letter", "gold locket", "music box",
         "lace shawl", "jade snuff-box", "coral necklace"]
CONTAINERS = ["walnut chest", "rosewood box", "japanned cabinet", "leather trunk", "tea caddy", "sewing basket",
              "oak bureau", "hat box"]
ROOM_ADJ = ["saffron", "cerulean", "heliotrope", "chartreuse", "amaranth", "celadon", "viridian", "vermilion"]
ROOMS = ["parlour", "gallery", "antechamber", "boudoir", "conservatory", "study"]
TOWN_HEAD = ["Bracken", "Hollin", "Sedge", "Fenny", "Tansey", "Oxlip", "Wendle", "Scarrow", "Brindle", "Pellow"]
TOWN_TAIL = ["field", "combe", "stead", "minster", "leigh", "thorpe", "wick"]
COUNTY_HEAD = ["Glimmer", "Wortle", "Quenby", "Harrow", "Mistle", "Dorrin", "Fallow", "Yarrow"]


def _key(rng: random.Random, taken: set[str]) -> str:
    while True:
        k = f"{rng.choice(KEY_ADJ)}-{rng.choice(KEY_NOUN)}"
        if k not in taken:
            taken.add(k)
            return k


def _value(kind: str, rng: random.Random, taken: set[str]) -> str:
    while True:
        if kind == "number":
            v = str(rng.randint(10000, 99999))
        elif kind == "word":
            v = rng.choice(CODE_WORDS)
        else:
            v = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        # no value may be a prefix of another or share a word: every part must be told apart by containment
        if not any(set(v.split()) & set(t.split()) for t in taken):
            taken.add(v)
            return v


@dataclass
class Plan:
    """One document before its haystack is sized: what to plant, at what depth, and what to ask."""

    needles: list[tuple[float, str]]  # (depth in [0, 1], sentence), in reading order
    questions: list[str]
    parts: list[list[str]]
    kinds: list[str]
    evidence: list[list[str]]
    once: list[str]  # strings that must occur exactly once in the finished text
    body: Optional[str] = None  # the whole context, for tasks without a haystack (common_words)


def _depths(rng: random.Random, n: int) -> list[float]:
    return sorted(rng.uniform(0.05, 0.95) for _ in range(n))


def plan_niah_single(rng: random.Random) -> Plan:
    keys, values = set(), set()
    statement, question = rng.choice(STATEMENTS), rng.choice(QUESTIONS)
    facts = []
    for kind in ("number", "word", "name"):
        key, noun, value = _key(rng, keys), rng.choice(NOUNS[kind]), _value(kind, rng, values)
        facts.append((kind, statement.format(noun=noun, key=key, value=value), question.format(noun=noun, key=key),
                      value))
    rng.shuffle(facts)
    needles = list(zip(_depths(rng, 3), [s for _, s, _, _ in facts]))
    return Plan(needles, [q for *_, q, _ in facts], [[v] for *_, v in facts], [k for k, *_ in facts],
                [[s] for _, s, _, _ in facts], [v for *_, v in facts])


def _four_facts(rng: random.Random, questions: list[str]):
    """(kind, noun, question template, four (key, value) facts, their sentences) for a multi-needle plan."""
    kind = rng.choice(sorted(NOUNS))
    noun, statement, question = rng.choice(NOUNS[kind]), rng.choice(STATEMENTS), rng.choice(questions)
    keys, values = set(), set()
    facts = [(k, _value(kind, rng, values)) for k in (_key(rng, keys) for _ in range(4))]
    return kind, noun, question, facts, [statement.format(noun=noun, key=k, value=v) for k, v in facts]


def plan_niah_multikey(rng: random.Random) -> Plan:
    kind, noun, question, facts, sentences = _four_facts(rng, QUESTIONS)
    return Plan(list(zip(_depths(rng, 4), sentences)), [question.format(noun=noun, key=k) for k, _ in facts],
                [[v] for _, v in facts], [kind] * 4, [[s] for s in sentences], [v for _, v in facts])


def plan_niah_multivalue(rng: random.Random) -> Plan:
    kind = rng.choice(("number", "word"))
    noun, statement, question = rng.choice(NOUNS[kind]), rng.choice(MULTI_STATEMENTS), rng.choice(MULTI_QUESTIONS)
    keys, values = set(), set()
    per_key = [(k, [_value(kind, rng, values) for _ in range(4)]) for k in (_key(rng, keys) for _ in range(2))]
    plants = [(k, v) for k, vs in per_key for v in vs]
    rng.shuffle(plants)
    sentences = {v: statement.format(noun=noun, key=k, value=v) for k, v in plants}
    return Plan(list(zip(_depths(rng, len(plants)), [sentences[v] for _, v in plants])),
                [question.format(noun=noun, key=k) for k, _ in per_key], [vs for _, vs in per_key], [kind] * 2,
                [[sentences[v] for v in vs] for _, vs in per_key], [v for _, v in plants])


def plan_niah_multiquery(rng: random.Random) -> Plan:
    kind, noun, question, facts, sentences = _four_facts(rng, QUERY_QUESTIONS)
    order = list(range(4))
    rng.shuffle(order)
    pairs = [order[:2], order[2:]]
    return Plan(list(zip(_depths(rng, 4), sentences)),
                [question.format(noun=noun, key=facts[i][0], key2=facts[j][0]) for i, j in pairs],
                [[facts[i][1], facts[j][1]] for i, j in pairs], [kind] * 2,
                [[sentences[i], sentences[j]] for i, j in pairs], [v for _, v in facts])


def plan_variable_tracking(rng: random.Random, hops: int = 4, chains: int = 2) -> Plan:
    first, then = rng.choice(VT_FORMS)
    question = rng.choice(VT_QUESTIONS)
    names: set[str] = set()
    values: set[str] = set()
    out_chains = []
    for _ in range(chains):
        chain = []
        while len(chain) < hops + 1:
            n = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
            if n not in names:
                names.add(n)
                chain.append(n)
        out_chains.append((chain, _value("number", rng, values)))
    # Each chain's statements in order, at increasing depths; the two chains interleave.
    steps = [(c, i) for c in range(chains) for i in range(hops + 1)]
    depths = {c: _depths(rng, hops + 1) for c in range(chains)}
    needles, evidence = [], [[] for _ in range(chains)]
    for c, i in steps:
        chain, v = out_chains[c]
        s = first.format(a=chain[0], v=v) if i == 0 else then.format(a=chain[i], b=chain[i - 1])
        needles.append((depths[c][i], s))
        evidence[c].append(s)
    needles.sort(key=lambda x: x[0])
    return Plan(needles, [question.format(v=v) for _, v in out_chains], [chain for chain, _ in out_chains],
                ["variables"] * chains, evidence, [v for _, v in out_chains])


def plan_two_hop(rng: random.Random, chains: int = 2) -> Plan:
    first, second, question = rng.choice(TWO_HOP)
    rooms = "room" in question
    used: set[str] = set()

    def draw(pool_fn):
        while True:
            x = pool_fn()
            if x not in used:
                used.add(x)
                return x

    needles, questions, parts, evidence, once = [], [], [], [], []
    for _ in range(chains):
        if rooms:
            a = draw(lambda: rng.choice(ITEMS))
            b = draw(lambda: rng.choice(CONTAINERS))
            c = draw(lambda: f"{rng.choice(ROOM_ADJ)} {rng.choice(ROOMS)}")
        else:
            a = draw(lambda: f"{rng.choice(FIRST)} {rng.choice(LAST)}")
            b = draw(lambda: rng.choice(TOWN_HEAD) + rng.choice(TOWN_TAIL))
            c = draw(lambda: rng.choice(COUNTY_HEAD) + "shire")
        s1, s2 = first.format(a=a, b=b), second.format(b=b, c=c)
        d1, d2 = rng.uniform(0.05, 0.95), rng.uniform(0.05, 0.95)  # either hop may come first
        needles += [(d1, s1), (d2, s2)]
        questions.append(question.format(a=a))
        parts.append([c])
        evidence.append([s1, s2])
        once += [a, c]
    needles.sort(key=lambda x: x[0])
    return Plan(needles, questions, parts, ["two_hop"] * chains, evidence, once)


def plan_common_words(rng: random.Random, length: int, vocab: Sequence[str], count: TokenCounter,
                      n_common: int = 10, freq_common: int = 30, freq_rare: int = 3) -> Plan:
    words = rng.sample(list(vocab), len(vocab))
    common, rare_pool = words[:n_common], words[n_common:]
    order = rng.random()  # one shuffle seed for every size tried, so the search sees one list growing

    def body(n_rare: int, freq: int) -> str:
        entries = [w for w in common for _ in range(freq)] + [w for w in rare_pool[:n_rare] for _ in range(freq_rare)]
        random.Random(order).shuffle(entries)
        return " ".join(f"{i}. {w}" for i, w in enumerate(entries, 1))

    # Ten common words at 30 repeats; a length that cannot hold them gets fewer (but above the rare count).
    freq = freq_common
    while freq > freq_rare + 1 and count(body(0, freq)) > length:
        freq -= 1
    n_rare = _largest(lambda n: count(body(n, freq)) <= length, len(rare_pool))
    question = rng.choice(CWE_QUESTIONS).format(n=n_common)
    return Plan([], [question], [list(common)], ["common_words"], [[f"{w} x{freq}" for w in common]], [],
                body=body(n_rare, freq))


def _largest(ok: Callable[[int], bool], hi: int) -> int:
    """The largest n in [0, hi] with ok(n) (ok is monotone: true up to some n), or 0."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


PLANNERS = {"niah_single": plan_niah_single, "niah_multikey": plan_niah_multikey,
            "niah_multivalue": plan_niah_multivalue, "niah_multiquery": plan_niah_multiquery,
            "variable_tracking": plan_variable_tracking, "two_hop": plan_two_hop}


# -- sizing a haystack around the needles --------------------------------------------------------------------
def render(sentences: Sequence[Sentence], needles: Sequence[tuple[float, str]]) -> str:
    """The sentences as paragraphs with each needle planted before the open sentence nearest its depth (the
    end only when no sentence is open), so never inside a quotation or after a cut-off last sentence."""
    n = len(sentences)
    spots = [i for i, s in enumerate(sentences) if s.open] or [n]
    at: dict[int, list[str]] = {}
    for depth, s in needles:
        want = depth * n
        at.setdefault(min(spots, key=lambda i: (abs(i - want), i)), []).append(s)
    paras: list[list[str]] = []
    last = None
    for i, sent in enumerate(sentences):
        if sent.para != last:
            paras.append([])
            last = sent.para
        paras[-1].extend(at.get(i, []))
        paras[-1].append(sent.text)
    if n in at:
        if not paras:
            paras.append([])
        paras[-1].extend(at[n])
    return "\n\n".join(" ".join(p) for p in paras)


def fit(hay: Sequence[Sentence], start: int, needles: Sequence[tuple[float, str]], length: int,
        count: TokenCounter) -> str:
    """The longest run of haystack text from ``start`` (wrapping; whole sentences, then the words of one more)
    whose text with the needles is at most ``length`` tokens."""

    def take(n: int) -> list[Sentence]:
        return [hay[(start + i) % len(hay)] for i in range(n)]

    def text(n: int, words: int = 0) -> str:
        nxt = hay[(start + n) % len(hay)]
        tail = [Sentence(nxt.para, " ".join(nxt.text.split()[:words]), False)] if words else []
        return render(take(n) + tail, needles)

    hi = max(8, length // 40)  # fewer sentences than that many tokens hold
    while count(text(hi)) <= length:
        hi *= 2
        if hi > 4 * len(hay):
            raise ValueError(f"the haystack ({len(hay)} sentences) is too short for {length} tokens")
    n = _largest(lambda k: count(text(k)) <= length, hi)
    nxt = hay[(start + n) % len(hay)].text.split()
    return text(n, _largest(lambda w: count(text(n, w)) <= length, len(nxt) - 1))


# -- documents ---------------------------------------------------------------------------------------------
def length_label(length: int) -> str:
    """``2k``, ``8k`` (7,936 tokens: an 8k window less room for the prompt and the answer), or the number."""
    return f"{round(length / 1024)}k" if length >= 1024 else str(length)


def vocabulary(hay: Sequence[Sentence]) -> list[str]:
    """Lower-case words of 5-9 letters that occur in the haystack, sorted (for common_words)."""
    return sorted({w for s in hay for w in re.findall(r"\b[a-z]{5,9}\b", s.text)})


def make_document(task: str, length: int, index: int, seed: int, hay: Sequence[Sentence], vocab: Sequence[str],
                  count: TokenCounter) -> dict:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    rng = random.Random(f"{seed}:{task}:{length}:{index}")
    for _ in range(100):  # redraw until every value occurs exactly once (the haystack never supplies one)
        if task == "common_words":
            plan = plan_common_words(rng, length, vocab, count)
            text = plan.body
        else:
            plan = PLANNERS[task](rng)
            starts = [i for i, s in enumerate(hay) if s.open]
            text = fit(hay, rng.choice(starts), plan.needles, length, count)
        if all(len(re.findall(rf"\b{re.escape(v)}\b", text)) == 1 for v in plan.once):
            break
    else:
        raise RuntimeError(f"{task} at {length} tokens: could not plant values that occur once")
    label = length_label(length)
    return {
        "doc_id": f"{task}-{label}-{index:03d}", "title": f"{task} ({label} tokens) #{index}", "text": text,
        "questions": plan.questions, "answers": [", ".join(p) for p in plan.parts], "task": task,
        "length": length, "n_tokens": count(text), "kinds": plan.kinds, "parts": plan.parts,
        "evidence": plan.evidence,
    }


def generate(count: TokenCounter, lengths: Sequence[int] = SIZES["standard"].lengths, per_task: int = 2,
             seed: int = 0, tasks: Sequence[str] = TASKS, austen: Optional[Path] = None) -> list[dict]:
    """Every task x length x index as a document row (see the module doc); ``count(text)`` -> tokens."""
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise ValueError(f"unknown tasks {bad}; known: {', '.join(TASKS)}")
    if per_task < 1 or not lengths or any(int(n) < 256 for n in lengths):
        raise ValueError(f"need per_task >= 1 and lengths >= 256 tokens, got per_task={per_task}, lengths={lengths}")
    hay = haystack(austen)
    vocab = vocabulary(hay)
    return [make_document(t, int(n), i, seed, hay, vocab, count) for n in lengths for t in tasks
            for i in range(per_task)]


def summary_documents(count: TokenCounter, lengths: Sequence[int], per_length: int = 1, seed: int = 0,
                      austen: Optional[Path] = None) -> list[dict]:
    """Plain Austen text (no needles, no questions) of each length, for comparing compressed summaries with
    the uncompressed one; ``task`` is ``summary``."""
    hay = haystack(austen)
    starts = [i for i, s in enumerate(hay) if s.open]
    rows = []
    for n in lengths:
        for i in range(per_length):
            rng = random.Random(f"{seed}:summary:{n}:{i}")
            text = fit(hay, rng.choice(starts), [], int(n), count)
            label = length_label(int(n))
            rows.append({"doc_id": f"summary-{label}-{i:03d}", "title": f"summary ({label} tokens) #{i}", "text": text,
                         "questions": None, "answers": None, "task": "summary", "length": int(n),
                         "n_tokens": count(text), "kinds": [], "parts": [], "evidence": []})
    return rows


SCHEMA = pa.schema([
    ("doc_id", pa.string()), ("title", pa.string()), ("text", pa.string()), ("questions", pa.list_(pa.string())),
    ("answers", pa.list_(pa.string())), ("task", pa.string()), ("length", pa.int32()), ("n_tokens", pa.int32()),
    ("kinds", pa.list_(pa.string())), ("parts", pa.list_(pa.list_(pa.string()))),
    ("evidence", pa.list_(pa.list_(pa.string()))),
])


def write(rows: Sequence[dict], path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(rows), schema=SCHEMA), path, compression="zstd")
    return path


def token_counter(tokenizer) -> TokenCounter:
    """Tokens of a text under ``tokenizer``, as the runner encodes a context (no special tokens added)."""
    from pipeline.prompts import encode

    return lambda text: len(encode(tokenizer, text))
