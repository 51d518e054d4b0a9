"""Write the tool demo's second SFT start: demonstrations that all call the calculator (recipes/tool_sft_calls.yaml).

    python scripts/tool_sft_calls.py [--demos 900] [--out recipes/data]

products_sft_calls.jsonl (data.format sft): `--demos` conversations of scripts/tool_problems.py's demonstrator
that call the calculator every time (the user's question, an assistant turn that calls it, the tool's result,
"The answer is N."), each carrying the calculator's schema as `tools`: as many conversations as
products_sft.jsonl, whose first 300 calls are its 300 (the same seeded stream), and none answered at once. The
start of recipes/tool_sft.yaml is built to prefer answering from its head; this one is built to call, so
bench/rl_vs_sft.py --demo tools can say what RL with the tool gains over each. The shipped file is this script's
output at its defaults (tests/test_scripts.py checks they agree).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.tool_problems import records  # noqa: E402
from scripts.word_problems import write_jsonl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demos", type=int, default=900, help="conversations, each calling the calculator (default 900)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "recipes" / "data"))
    args = ap.parse_args()
    calls, _ = records(args.demos, 0, 0, 0)
    write_jsonl(Path(args.out), {"products_sft_calls.jsonl": calls}, "scripts/tool_sft_calls.py")


if __name__ == "__main__":
    main()
