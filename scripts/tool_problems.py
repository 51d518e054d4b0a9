"""Write the tool demo's data: products of a 3-digit and a 2-digit number, which a tiny model cannot work out
in its head, and a calculator tool that can (ds_train.ript.tools:calculator).

    python scripts/tool_problems.py [--demos 300] [--direct 500] [--no-tool 100] [--prompts 4000] [--out recipes/data]

products_sft.jsonl, the demonstrations (data.format sft), as a demonstrator who reaches for the calculator
now and then would write them: `--demos` conversations that call it (the user's question, an assistant turn
that calls the calculator, the tool's result, the answer), and `--direct` in which the calculator is offered
and the answer is given at once; each carries the calculator's JSON schema as `tools`, so the chat template
renders the prompt exactly as ds-train ript does for a task with `tools: [ds_train.ript.tools:calculator]`.
Then `--no-tool` answered at once with no tool offered (the prompt of a task without `tools`). The start knows
how to call the tool, and prefers not to.
products.jsonl: `--prompts` problems as {"prompt", "answer"}, the dataset recipes/tool_demo.yaml post-trains on
(ds-train ript holds a tenth out by a hash of the prompt). The question comes in a few wordings, so a model has
to read which two numbers to multiply. The shipped files are this script's output at its defaults
(tests/test_scripts.py checks they agree).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.word_problems import write_jsonl  # noqa: E402

WORDINGS = ["What is {a} times {b}?",
            "Compute {a} * {b}.",
            "How much is {a} multiplied by {b}?",
            "A crate holds {b} boxes of {a} nails. How many nails are in the crate?",
            "Each of {b} buses carries {a} bottles. How many bottles are there in all?"]


def problem(rng: random.Random) -> tuple[str, int, int]:
    """A question and its two factors: a from 100 to 999, b from 10 to 99."""
    a, b = rng.randint(100, 999), rng.randint(10, 99)
    return rng.choice(WORDINGS).format(a=a, b=b), a, b


def answer(n: int) -> str:
    """The last turn, with or without the tool: one wording, so a reply that answers at once starts the same
    way every time (and a greedy start, which picks that over a call, prefers not to call)."""
    return f"The answer is {n}."


def records(demos: int, direct: int, no_tool: int, prompts: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(the SFT conversations, shuffled; the RL prompts), from seeded streams."""
    from ds_train.ript.environments import tool_schema
    from ds_train.ript.tools import calculator

    tools = [tool_schema(calculator, "calculator")]
    rng = random.Random(f"tool-problems:sft:{seed}")
    sft = []
    for _ in range(demos):
        q, a, b = problem(rng)
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}}
        sft.append({"tools": tools,
                    "messages": [{"role": "user", "content": q},
                                 {"role": "assistant", "content": "", "tool_calls": [call]},
                                 {"role": "tool", "content": calculator(f"{a} * {b}")},
                                 {"role": "assistant", "content": answer(a * b)}]})
    rng = random.Random(f"tool-problems:direct:{seed}")
    for i in range(direct + no_tool):
        q, a, b = problem(rng)
        sft.append({**({"tools": tools} if i < direct else {}),
                    "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": answer(a * b)}]})
    random.Random(f"tool-problems:order:{seed}").shuffle(sft)
    rng = random.Random(f"tool-problems:rl:{seed}")
    rl = []
    for _ in range(prompts):
        q, a, b = problem(rng)
        rl.append({"prompt": q, "answer": a * b})
    return sft, rl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demos", type=int, default=300, help="conversations that call the calculator (default 300)")
    ap.add_argument("--direct", type=int, default=500, help="answered at once, the calculator offered (default 500)")
    ap.add_argument("--no-tool", type=int, default=100, help="answered at once, no tool offered (default 100)")
    ap.add_argument("--prompts", type=int, default=4000, help="problems to post-train on (default 4000)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "recipes" / "data"))
    args = ap.parse_args()
    sft, rl = records(args.demos, args.direct, args.no_tool, args.prompts)
    write_jsonl(Path(args.out), {"products_sft.jsonl": sft, "products.jsonl": rl}, "scripts/tool_problems.py")


if __name__ == "__main__":
    main()
