"""Rebuild data/sample_batch.parquet and data/eval_set.parquet from the public-domain Austen novels.

    python data/build_datasets.py [--austen DIR] [--out DIR]

Each document is the opening of one chapter (whole paragraphs) with invented facts planted at sentence
boundaries, and one question per fact whose gold answer is a short string (a code, number, name, ...) so a
small model's answer can be checked by containment. Everything is drawn from one seeded RNG, so two runs
write byte-identical files (with the same pyarrow version).
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# The novels' reader is shared with the synthetic long-context tasks.
from pipeline.tasks.text import NOVELS_DIR, boundaries, novel_file, read_chapters

SEED = 20240611
NOVELS = {  # doc_id prefix -> (file, title)
    "pp": ("prideprejudice.txt", "Pride and Prejudice"),
    "ss": ("sensesensibility.txt", "Sense and Sensibility"),
    "na": ("northangerabbey.txt", "Northanger Abbey"),
    "mp": ("mansfieldpark.txt", "Mansfield Park"),
}
SAMPLE_NOVELS = ["pp", "ss", "na", "mp", "pp"]
SAMPLE_WORDS = (800, 1500, 1000)  # (min, max, stop adding paragraphs once reached)
EVAL_PER_NOVEL = 5
EVAL_WORDS = (1250, 1550, 1360)

# (fact sentence, question) per kind; {v} is the gold answer.
TEMPLATES = {
    "code": [
        ("The gardener's locker code was {v}.", "What was the gardener's locker code?"),
        ("The combination of the strong-box in the library was {v}.",
         "What was the combination of the strong-box in the library?"),
        ("The trunk sent on by the carrier was labelled {v}.", "What label was on the trunk sent on by the carrier?"),
        ("The ticket for the mail-coach bore the number {v}.", "What number did the ticket for the mail-coach bear?"),
    ],
    "name": [
        ("The name signed at the foot of the anonymous letter was {v}.",
         "Whose name was signed at the foot of the anonymous letter?"),
        ("The godparent named in the old will was {v}.", "Who was the godparent named in the old will?"),
        ("The cottage by the mill had been let to {v}.", "To whom had the cottage by the mill been let?"),
        ("The portrait over the dining-room chimney-piece was of {v}.",
         "Whose portrait hung over the dining-room chimney-piece?"),
    ],
    "number": [
        ("The repairs to the old stables had cost exactly {v} guineas.",
         "How many guineas had the repairs to the old stables cost?"),
        ("The library at the great house held {v} volumes.", "How many volumes did the library at the great house hold?"),
        ("The walk from the lodge to the church measured {v} paces.",
         "How many paces did the walk from the lodge to the church measure?"),
        ("The housekeeper counted {v} jars of preserves in the still-room.",
         "How many jars of preserves did the housekeeper count in the still-room?"),
    ],
    "place": [
        ("The parcel had been sent from the town of {v}.", "From which town had the parcel been sent?"),
        ("The family's old nurse had retired to a village called {v}.",
         "To which village had the family's old nurse retired?"),
        ("The new carriage horses had been bought at the fair in {v}.",
         "Where had the new carriage horses been bought?"),
        ("The vicar's brother kept a school at {v}.", "Where did the vicar's brother keep a school?"),
    ],
    "colour": [
        ("The door of the summer-house had been painted {v}.",
         "What colour had the door of the summer-house been painted?"),
        ("The ribbon on the new bonnet was {v}.", "What colour was the ribbon on the new bonnet?"),
        ("The curtains in the breakfast-parlour were a deep {v}.",
         "What colour were the curtains in the breakfast-parlour?"),
    ],
    "object": [
        ("Hidden in the old writing-desk was a small brass {v}.", "What was hidden in the old writing-desk?"),
        ("The prize at the card-table that evening was a silver {v}.",
         "What was the prize at the card-table that evening?"),
        ("The sea-captain had brought home a carved ivory {v}.", "What had the sea-captain brought home?"),
    ],
}
FIRST = ["Ottoline", "Peregrine", "Cressida", "Thaddeus", "Griselda", "Lysander", "Philippa", "Crispin", "Leopoldine",
         "Ambrosine", "Barnabas", "Euphemia"]
LAST = ["Farquharson", "Quillfeather", "Thistlewood", "Marchbanks", "Ravensworth", "Dunstaple", "Kettleburn",
        "Wolverstone", "Pennycuick", "Haverbrook"]
PLACE_HEAD = ["Bracken", "Hollin", "Sedge", "Fenny", "Tansey", "Oxlip", "Wendle", "Scarrow", "Brindle", "Pellow"]
PLACE_TAIL = ["field", "combe", "stead", "minster", "leigh", "thorpe", "wick"]
COLOURS = ["vermilion", "saffron", "cerulean", "heliotrope", "chartreuse", "amaranth", "celadon", "viridian", "ochre",
           "turquoise"]
OBJECTS = ["telescope", "sextant", "astrolabe", "metronome", "kaleidoscope", "orrery", "hourglass", "pomander",
           "ear-trumpet"]


def draw_value(kind: str, rng: random.Random) -> str:
    if kind == "code":
        fmt = rng.choice(["L#-L#", "LL-###", "####"])
        return "".join(rng.choice("ABCDEFGHJKMNPQRTVWXY") if c == "L" else str(rng.randint(1, 9)) if c == "#" else c
                       for c in fmt)
    if kind == "name":
        return f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    if kind == "number":
        return str(rng.randint(121, 979))
    if kind == "place":
        return rng.choice(PLACE_HEAD) + rng.choice(PLACE_TAIL)
    return rng.choice(COLOURS if kind == "colour" else OBJECTS)


def excerpt(paras: list[str], words: tuple[int, int, int]) -> list[str] | None:
    """Leading whole paragraphs of a chapter within the word range (leaving room for two planted facts)."""
    lo, hi, stop = words
    out, n = [], 0
    for p in paras:
        k = len(p.split())
        if n >= stop or n + k > hi - 30:
            break
        out.append(p)
        n += k
    return out if n >= lo else None


def plant(paras: list[str], kinds: tuple[str, str], rng: random.Random, corpus: str, used: set[str]) -> dict:
    spots = boundaries(paras)
    for _ in range(10_000):  # redraw until both facts are new to the corpus and sit apart in the text
        facts = []
        for kind in kinds:
            sentence, question = rng.choice(TEMPLATES[kind])
            value = draw_value(kind, rng)
            facts.append((kind, sentence.format(v=value), question, value))
        where = sorted(rng.sample(spots, 2))
        if any(v.lower() in corpus or v in used for *_, v in facts) or facts[0][3] == facts[1][3]:
            continue
        new = list(paras)
        for (i, off), (_, sentence, _, _) in sorted(zip(where, facts), reverse=True):
            p = new[i]
            new[i] = f"{sentence} {p}" if off == 0 else f"{p[:off]} {sentence}{p[off:]}"
        text = "\n\n".join(new)
        depths = [text.index(s) / len(text) for _, s, _, _ in facts]
        if abs(depths[0] - depths[1]) >= 0.1 and all(text.count(v) == 1 for *_, v in facts):
            used.update(v for *_, v in facts)
            return {"text": text, "questions": [q for _, _, q, _ in facts], "answers": [v for *_, v in facts],
                    "fact_depths": depths, "fact_kinds": list(kinds)}
    raise RuntimeError(f"could not plant {kinds}: value pools exhausted")


def build(austen: Path) -> tuple[list[dict], list[dict]]:
    rng = random.Random(SEED)
    chapters = {key: read_chapters(novel_file(austen, fname)) for key, (fname, _) in NOVELS.items()}
    corpus = " ".join(p for ch in chapters.values() for paras in ch.values() for p in paras).lower()
    kind_pairs = list(itertools.combinations(sorted(TEMPLATES), 2))
    rng.shuffle(kind_pairs)
    used: set[str] = set()
    taken: set[tuple[str, int]] = set()

    def make(key: str, words: tuple[int, int, int]) -> dict:
        eligible = [n for n, paras in sorted(chapters[key].items()) if (key, n) not in taken and excerpt(paras, words)]
        n = rng.choice(eligible)
        taken.add((key, n))
        doc = plant(excerpt(chapters[key][n], words), kind_pairs[len(taken) % len(kind_pairs)], rng, corpus, used)
        return {"doc_id": f"{key}-ch{n:02d}", "title": f"{NOVELS[key][1]}, Chapter {n}", **doc}

    sample = [make(key, SAMPLE_WORDS) for key in SAMPLE_NOVELS]
    evals = [make(key, EVAL_WORDS) for key in NOVELS for _ in range(EVAL_PER_NOVEL)]
    return sample, evals


def write(rows: list[dict], path: Path, extra: bool) -> None:
    fields = [("doc_id", pa.string()), ("title", pa.string()), ("text", pa.string()),
              ("questions", pa.list_(pa.string())), ("answers", pa.list_(pa.string()))]
    if extra:
        fields += [("fact_depths", pa.list_(pa.float64())), ("fact_kinds", pa.list_(pa.string()))]
    schema = pa.schema(fields)
    rows = sorted(rows, key=lambda r: r["doc_id"])
    table = pa.table({name: [r[name] for r in rows] for name in schema.names}, schema=schema)
    pq.write_table(table, path, compression="zstd")


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--austen", type=Path, default=NOVELS_DIR,
                    help="folder with the Austen .txt files (default: the package's copy)")
    ap.add_argument("--out", type=Path, default=here.parent, help="output folder (default: data/)")
    args = ap.parse_args(argv)
    missing = [f for f, _ in NOVELS.values() if novel_file(args.austen, f) is None]
    if missing:
        print(f"error: Austen novels not found in {args.austen} (missing {', '.join(missing)}); pass --austen DIR",
              file=sys.stderr)
        return 2
    sample, evals = build(args.austen)
    args.out.mkdir(parents=True, exist_ok=True)
    write(sample, args.out / "sample_batch.parquet", extra=False)
    write(evals, args.out / "eval_set.parquet", extra=True)
    for name, rows in (("sample_batch", sample), ("eval_set", evals)):
        counts = ", ".join(f"{r['doc_id']}={len(r['text'].split())}" for r in sorted(rows, key=lambda r: r["doc_id"]))
        print(f"{name}: {len(rows)} documents ({counts})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
