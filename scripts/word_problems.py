"""Write the RL demo's data: arithmetic word problems with checkable answers (one JSON record a line).

    python scripts/word_problems.py [--demos 300] [--prompts 4000] [--out recipes/data]

word_problems_sft.jsonl: `--demos` solved problems as conversations (data.format sft), what
recipes/rl_sft.yaml fine-tunes on. word_problems.jsonl: `--prompts` problems as {"prompt", "answer"},
the dataset recipes/rl_demo.yaml post-trains on (ds-train ript holds a tenth of them out by a hash
of the prompt, for evaluation). One or two steps of addition or subtraction of numbers below 10, told
in a few wordings with different people and things, so the same sum appears in many sentences: a
model has to read which numbers and which operation. The files in the repository are this script's
output at its defaults (tests/test_scripts.py checks they agree).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

NAMES = ["Ana", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jo", "Kim", "Leo"]
THINGS = ["apples", "books", "coins", "pens", "shells", "stickers", "cards", "marbles", "plums", "stamps"]
ADD = ["{n} has {a} {t}. {n} gets {b} more {t}. How many {t} does {n} have now?",
       "There are {a} {t} in a box and {b} {t} in a bag. How many {t} are there in all?",
       "{n} found {a} {t} on Monday and {b} {t} on Tuesday. How many {t} did {n} find?"]
SUB = ["{n} has {a} {t} and gives {b} {t} away. How many {t} does {n} have left?",
       "There were {a} {t} on the table. {n} took {b} of them. How many {t} are on the table now?",
       "{n} had {a} {t} and lost {b}. How many {t} are left?"]


def problem(rng: random.Random) -> tuple[str, int]:
    """A problem and its answer: a + b (a, b from 1 to 9) or a - b (b below a)."""
    n, t = rng.choice(NAMES), rng.choice(THINGS)
    if rng.random() < 0.5:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return rng.choice(ADD).format(n=n, t=t, a=a, b=b), a + b
    a = rng.randint(2, 9)
    b = rng.randint(1, a - 1)
    return rng.choice(SUB).format(n=n, t=t, a=a, b=b), a - b


def prompt(question: str) -> str:
    return f"Q: {question}\nA:"


def records(demos: int, prompts: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(the SFT conversations, the RL prompts), from two seeded streams."""
    rng = random.Random(f"word-problems:sft:{seed}")
    sft = []
    for _ in range(demos):
        q, answer = problem(rng)
        sft.append({"messages": [{"role": "user", "content": prompt(q)},
                                 {"role": "assistant", "content": f" {answer}\n"}]})
    rng = random.Random(f"word-problems:rl:{seed}")
    rl = []
    for _ in range(prompts):
        q, answer = problem(rng)
        rl.append({"prompt": prompt(q), "answer": answer})
    return sft, rl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demos", type=int, default=300)
    ap.add_argument("--prompts", type=int, default=4000)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "recipes" / "data"))
    args = ap.parse_args()
    sft, rl = records(args.demos, args.prompts)
    write_jsonl(Path(args.out), {"word_problems_sft.jsonl": sft, "word_problems.jsonl": rl}, "scripts/word_problems.py")


def write_jsonl(out: Path, files: dict[str, list[dict]], script: str) -> None:
    """Each file's records in `out`, one JSON object a line; a path that cannot be written is one line naming it
    (and `script`), not a traceback."""
    for name, rows in files.items():
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        except OSError as e:
            sys.exit(f"{script}: cannot write {out / name}: {e.strerror or e}")
        print(f"wrote {len(rows)} records to {out / name}")


if __name__ == "__main__":
    main()
