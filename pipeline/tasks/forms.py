"""Surface forms: key words, value nouns, names, and the statement and question phrasings, drawn per document
so that no press wins by a template."""

from __future__ import annotations

import random

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


def draw_key(rng: random.Random, taken: set[str]) -> str:
    while True:
        k = f"{rng.choice(KEY_ADJ)}-{rng.choice(KEY_NOUN)}"
        if k not in taken:
            taken.add(k)
            return k


def draw_value(kind: str, rng: random.Random, taken: set[str]) -> str:
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

# Events planted in summary documents: each an occurrence a reader would retell, naming someone met nowhere else
# in the text (``plans.plan_summary_events``). The coverage of a summary is the share whose person it names.
EVENTS = [
    "That night a fire broke out in the stables of {town}, and a stranger named {name} carried the horses out "
    "through the smoke.",
    "A sea captain called {name} arrived at the door with a letter from {town} that changed everything.",
    "News came that {name} of {town} had won the great lottery and meant to buy the whole estate.",
    "At dawn {name} was found asleep in the garden, having walked all night from {town} through the storm.",
    "On the bridge at {town} the carriage of {name} overturned, and its passenger was carried into the house with "
    "a broken arm.",
    "In the middle of the service {name} stood up in the church at {town} and declared that the wedding must not "
    "go on.",
    "A box of jewels was stolen from the hall, and {name}, a pedlar from {town}, was taken before the magistrate.",
    "{name}, a painter from {town}, was engaged to paint the whole family, and quarrelled with every one of them.",
    "The river at {town} flooded the lower road, and {name} rowed a boat from house to house to bring the "
    "children out.",
    "A physician named {name} rode over from {town} and announced that the old gentleman had not long to live.",
]

