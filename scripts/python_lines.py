"""Write the Python-completion task's data: lines of the bundled corpus's held-out files, each after the lines
before it, beside three other lines of the same file (one JSON record a line).

    python scripts/python_lines.py [--items 240] [--out recipes/data]

The bundled corpus (`data.sources: [python-stdlib]`: this Python's standard-library source) splits its files
into train and val by a hash of each file's name (ds_train/data/encode.py, `data.val_fraction` 0.02): this
script reads only the val files, so neither the quickstart's model nor its tokenizer has seen a line of them.
Each record: `context` (up to 6 lines before the line, at most 320 characters, ending in a newline), `choices`
(the line that comes next, 16 to 80 characters, not blank, not a comment, and three other such lines of the
file, of a length within half of its, in a seeded order), `gold` (the next line's index), `source` and `line`
(where it is). recipes/lm_eval/python_lines.yaml scores them as lm_eval scores HellaSwag: which continuation the
model finds likeliest (acc), per byte (acc_norm). The file in the repository is this script's output at its
defaults on Python 3.11 (tests/test_scripts.py checks they agree).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_train.config import DataConfig  # noqa: E402
from ds_train.data.encode import _is_val  # noqa: E402
from ds_train.data.sources import STDLIB, source_files  # noqa: E402

CONTEXT_LINES, CONTEXT_CHARS, TARGET_CHARS = 6, 320, (16, 80)


def candidates(name: str, text: str) -> list[dict]:
    """Every line of one file that can be a target, with the lines before it."""
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        target = line.rstrip()
        if not TARGET_CHARS[0] <= len(target) <= TARGET_CHARS[1] or target.lstrip().startswith("#"):
            continue
        before = lines[max(0, i - CONTEXT_LINES):i]
        while before and len("\n".join(before)) + 1 > CONTEXT_CHARS:
            before = before[1:]
        if sum(bool(x.strip()) for x in before) < 2:
            continue
        out.append({"context": "\n".join(before) + "\n", "target": target, "source": name, "line": i + 1})
    return out


def with_choices(item: dict, pool: list[dict], rng: random.Random) -> dict | None:
    """The item as a question: its line and three other lines of its file of a like length, in a seeded order."""
    n = len(item["target"])
    others = sorted({c["target"] for c in pool if c["target"] != item["target"] and n / 2 <= len(c["target"]) <= n * 1.5})
    if len(others) < 3:
        return None
    choices = [item["target"], *rng.sample(others, 3)]
    rng.shuffle(choices)
    return {"context": item["context"], "choices": choices, "gold": choices.index(item["target"]),
            "source": item["source"], "line": item["line"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=240, help="lines to write (default 240)")
    p.add_argument("--out", default="recipes/data", help="directory to write python_lines.jsonl into")
    args = p.parse_args(argv)
    val_fraction = DataConfig().val_fraction
    held_out = [(name, path) for name, path in source_files(STDLIB) if _is_val(name, val_fraction)]
    pools = [candidates(name, path.read_text(encoding="utf-8", errors="replace")) for name, path in held_out]
    pools = [pool for pool in pools if pool]
    rng, picked = random.Random(0), []
    share = -(-args.items // max(1, len(pools)))  # as even over the files as their lines allow
    for pool in pools:
        items = (with_choices(item, pool, rng) for item in sorted(rng.sample(pool, min(share, len(pool))),
                                                                   key=lambda r: r["line"]))
        picked += [item for item in items if item is not None]
    picked = picked[:args.items]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "python_lines.jsonl").write_text("".join(json.dumps(r) + "\n" for r in picked))
    print(f"{out / 'python_lines.jsonl'}: {len(picked)} lines of {len(pools)} held-out files of "
          f"Python {sys.version_info.major}.{sys.version_info.minor}'s standard library")
    return 0


if __name__ == "__main__":
    sys.exit(main())
