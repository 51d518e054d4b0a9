"""What lm-evaluation-harness in the run costs: the README's main job (the quickstart) side by side, without a
benchmarks section, with one at the default interval (the last step only), and scoring every 100 steps and at the
start as well; evaluation's share of each run's time.

    python bench/benchmarks_cost.py [--tasks python_lines,arith_choice,arith_words] [--limit 0] [--repeats 1]
        [--out runs/bench_benchmarks]

Each run is `bash scripts/quickstart.sh output_dir=OUT/<side>_<repeat> [benchmarks...]` (2 processes, ZeRO-2,
300 steps), the sides in turn within each repeat (this machine is noisy: compare sides of one repeat).
Per run: launch-to-exit seconds, the scoring's seconds (`perf/benchmarks_s` summed from metrics.jsonl), the
start-up's input checks (results.json's startup_s: lm_eval's task index is built there to check the names), and
the scores of the last step. Prints a table and writes OUT/summary.json; BENCHMARKS.md takes its numbers by hand.
Needs lm_eval (`pip install -e '.[eval]'`) and no existing OUT/<side>_<repeat> (the runs would resume them):
--replace removes OUT first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDES = {"plain": [], "at_end": [], "every_100": ["benchmarks.every=100", "benchmarks.at_start=true"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="python_lines,arith_choice,arith_words", help="benchmarks.tasks (comma list)")
    p.add_argument("--limit", type=int, default=0, help="benchmarks.limit (0: every document)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of the three sides (default 1)")
    p.add_argument("--out", default="runs/bench_benchmarks", help="where the runs go (default runs/bench_benchmarks)")
    p.add_argument("--replace", action="store_true", help="remove --out first")
    p.add_argument("--steps", type=int, default=0, help="train.max_steps (0: the recipe's 300)")
    return p.parse_args(argv)


def overrides(side: str, args: argparse.Namespace, run_dir: Path) -> list[str]:
    out = [f"output_dir={run_dir}", "log.plots=false"] + ([f"train.max_steps={args.steps}"] if args.steps else [])
    if side == "plain":
        return out
    return out + [f"benchmarks.tasks=[{args.tasks}]", f"benchmarks.limit={args.limit}", *SIDES[side]]


def measure(side: str, args: argparse.Namespace, run_dir: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    t0 = time.perf_counter()
    res = subprocess.run(["bash", "scripts/quickstart.sh", *overrides(side, args, run_dir)], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"benchmarks_cost: {side} failed (exit {res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in rows if "perf/benchmarks_s" in r]
    results = json.loads((run_dir / "results.json").read_text())
    return {"side": side, "wall_s": round(wall, 1), "scorings": len(scored),
            "scoring_s": round(sum(r["perf/benchmarks_s"] for r in scored), 1),
            "startup_s": sum((results.get("startup_s") or {}).values()),
            "input_checks_s": (results.get("startup_s") or {}).get("inputs"),
            "final_eval_loss": results.get("final_eval_loss"),
            "scores": {k: round(v, 4) for k, v in (scored[-1] if scored else {}).items() if k.startswith("bench/")}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = (ROOT / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    if args.replace:
        shutil.rmtree(out, ignore_errors=True)
    runs = []
    for repeat in range(args.repeats):
        for side in SIDES:
            run_dir = out / f"{side}_{repeat}"
            if run_dir.exists():
                sys.exit(f"benchmarks_cost: {run_dir} exists (the run would resume it); give --replace")
            runs.append(measure(side, args, run_dir) | {"repeat": repeat})
            print(json.dumps(runs[-1]), flush=True)
    print("\n| side | wall s | scorings | scoring s | input checks s | wall / plain | evaluation's share |\n"
          "|---|---|---|---|---|---|---|")
    for r in runs:
        plain = next(p for p in runs if p["side"] == "plain" and p["repeat"] == r["repeat"])
        extra = r["wall_s"] - plain["wall_s"]
        print(f"| {r['side']} (repeat {r['repeat']}) | {r['wall_s']} | {r['scorings']} | {r['scoring_s']} | "
              f"{r['input_checks_s']} | "
              f"{r['wall_s'] / plain['wall_s']:.2f} | {max(0.0, extra) / r['wall_s']:.1%} |")
    (out / "summary.json").write_text(json.dumps({"tasks": args.tasks, "limit": args.limit, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
