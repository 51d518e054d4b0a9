"""Write the RIPT demonstrations as a conversations file (data.format sft), one JSON record a line:

    python scripts/ript_demos.py [--per-task 48] [--out recipes/data/ript_demos.jsonl]

Each built-in task's solved transcript of N training contexts: the prompt and each observation a
user turn, each answer an assistant turn. recipes/ript_sft.yaml trains on it; the file in the
repository is this script's output (tests/test_ript.py checks they agree).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ds_train.ript.tasks import demonstration_records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-task", type=int, default=48)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "recipes/data/ript_demos.jsonl"))
    args = ap.parse_args()
    lines = [json.dumps(r) for r in demonstration_records(args.per_task)]
    try:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    except OSError as e:  # a path that cannot be written: one line, not a traceback
        sys.exit(f"scripts/ript_demos.py: cannot write {args.out}: {e.strerror or e}")
    print(f"wrote {len(lines)} conversations to {args.out}")


if __name__ == "__main__":
    main()
