"""Writes recipes/data/preference_pairs.jsonl: generated preference pairs for recipes/dpo.yaml and
bench/dpo.py. Each record is {"prompt", "chosen", "rejected"}: a request, a helpful reply and a
reply a person would reject, of three kinds a small model can learn to tell apart from data alone:

    tone        a kind description of a named friend / a rude one
    refusal     an answer that takes up the request / a refusal
    repetition  one sentence / the subject repeated over and over
    faithful    a greeting to the person the prompt names / to someone else (the reply must
                copy a name from the prompt: tone and form alone cannot tell these apart)

The names, places and things are drawn from fixed lists in a seeded order, so held-out pairs
combine them anew. It shows the preference machinery working, not the quality of an alignment.

    python scripts/preference_pairs.py --out recipes/data [--pairs 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

NAMES = ["Ada", "Bruno", "Chen", "Dara", "Elif", "Femi", "Goran", "Hana", "Ivo", "Jun", "Kemal", "Lena", "Mira",
         "Nils", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara", "Uma", "Viktor", "Wen", "Yara", "Zoe"]
THINGS = ["garden", "river", "bridge", "library", "market", "harbour", "forest", "castle", "village", "museum",
          "station", "orchard", "valley", "island", "lighthouse", "bakery", "meadow", "theatre", "canal", "tower"]
KIND = ["friendly", "helpful", "patient", "generous", "thoughtful", "honest", "cheerful", "gentle", "brave", "wise"]
RUDE = ["stupid", "useless", "boring", "awful", "pathetic", "lazy", "ugly", "annoying", "worthless", "dull"]
NICE = ["quiet", "lovely", "peaceful", "bright", "charming", "old", "green", "calm", "beautiful", "busy"]
VERBS = ["visit", "describe", "find", "reach", "photograph", "explore"]


def pair(rng: random.Random) -> dict:
    kind = rng.choice(("tone", "refusal", "repetition", "faithful"))
    if kind == "faithful":
        name, other = rng.sample(NAMES, 2)
        place = rng.choice(THINGS)
        return {"prompt": f"Write a greeting for {name} at the {place}.",
                "chosen": f"Welcome to the {place}, {name}!", "rejected": f"Welcome to the {place}, {other}!"}
    if kind == "tone":
        name = rng.choice(NAMES)
        return {"prompt": f"Tell me about my friend {name}.",
                "chosen": f"{name} sounds {rng.choice(KIND)} and {rng.choice(KIND)}.",
                "rejected": f"{name} is {rng.choice(RUDE)} and {rng.choice(RUDE)}."}
    thing = rng.choice(THINGS)
    if kind == "refusal":
        verb = rng.choice(VERBS)
        return {"prompt": f"How do I {verb} the {thing}?",
                "chosen": f"To {verb} the {thing}, start early; the {thing} is {rng.choice(NICE)} in the morning.",
                "rejected": rng.choice(["I cannot help with that.", "No.", "Ask someone else.",
                                        "I will not answer that."])}
    return {"prompt": f"Describe the {thing} in one sentence.",
            "chosen": f"The {thing} is {rng.choice(NICE)} and {rng.choice(NICE)}.",
            "rejected": " ".join([thing] * rng.randint(5, 9))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="recipes/data", help="directory to write preference_pairs.jsonl into")
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out) / "preference_pairs.jsonl"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(pair(rng)) + "\n" for _ in range(args.pairs)))
    except OSError as e:  # a path that cannot be written: one line, not a traceback
        sys.exit(f"scripts/preference_pairs.py: cannot write {out}: {e.strerror or e}")
    print(f"wrote {args.pairs} pairs to {out}")


if __name__ == "__main__":
    main()
