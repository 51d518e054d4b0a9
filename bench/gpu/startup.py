"""Launch to first step: ds_train (its defaults) against the bare DeepSpeed loop, split by phase.

    python bench/gpu/startup.py --out OUT [--from-mfu MFU_JSON]
    python bench/gpu/startup.py --out OUT --reduced --data DIR      # the CPU check the suite runs

The ~1.1B Llama of mfu.py on one GPU (ZeRO-2, bf16, seq 2048, micro-batch 8 x accumulation 4). Each
side is one process, launched as mfu.py launches its sides, for 2 optimizer steps: ds_train with
`ds-train train` (its phases are results.json's startup_s, from its own clock:
ds_train/observe/startup.py), bare with mfu.py's bare loop, clocked alike (imports, model, engine,
first step). Both clocks start at the process's creation and stop at the end of the first optimizer
step, the device synchronised. With --from-mfu (an mfu.json whose ds_train and bare sides carry
startup_s: mfu.py clocks its sides the same way) nothing is launched and that run's figures are used.

results: OUT/startup.json: each side's phases and total, ds_train - bare (the issue asks <= 15 s), and
ds_train's phases against the bare loop's counterparts, largest excess first.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mfu  # noqa: E402
from common import LLAMA_1B, add_common_args, start, write_results  # noqa: E402
from bench import cli  # noqa: E402

TARGET_S = 15.0  # ds_train's launch to first step at most this much over the bare loop's
# ds_train's phases -> the bare loop's phase that does the same work ("" : the bare loop has none)
COUNTERPART = {"imports": "imports", "inputs": "", "process group": "", "model": "model", "engine": "engine",
               "run set-up": "", "resume": "", "reference": "", "first step": "first step"}


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--from-mfu", help="an mfu.json with both sides' startup_s: summarise it, launch nothing")
    return p.parse_args(argv)


def launched(args, out: Path) -> dict:
    """Both sides, 2 optimizer steps each (the first timed for start-up), one process each."""
    margs = mfu.parse_args(["--out", str(out), "--data", args.data, "--timeout", str(args.timeout),
                            "--warmup", "1", "--steps", "1", *(["--reduced"] if args.reduced else [])])
    margs.steps, margs.warmup = 1, 1
    _, model, seq, dtype = start(margs, LLAMA_1B)
    sides = {"ds_train": mfu.ds_train_side(margs, out, "ds_train", model, seq, dtype)}
    sides["bare"] = mfu.worker_sides(margs, out, ["bare"])["bare"]
    return sides


def compare(sides: dict) -> dict:
    """Totals, the difference, and ds_train's phases beside the bare loop's counterparts."""
    ours, bare = sides["ds_train"]["startup_s"], sides["bare"]["startup_s"]
    rows = []
    for phase, s in ours.items():
        twin = COUNTERPART.get(phase, "")
        rows.append({"phase": phase, "ds_train_s": s, "bare_phase": twin or None,
                     "bare_s": bare.get(twin, 0.0) if twin else 0.0})
    for row in rows:
        row["excess_s"] = row["ds_train_s"] - row["bare_s"]
    total = {name: sum(p.values()) for name, p in (("ds_train", ours), ("bare", bare))}
    return {"total_s": total, "difference_s": total["ds_train"] - total["bare"], "target_s": TARGET_S,
            "within": total["ds_train"] - total["bare"] <= TARGET_S,
            "phases": sorted(rows, key=lambda r: -r["excess_s"]), "bare_phases": bare}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.from_mfu:
        sides = {k: v for k, v in json.loads(Path(args.from_mfu).read_text())["sides"].items()
                 if k in ("ds_train", "bare")}
        source = args.from_mfu
    else:
        sides, source = launched(args, out), "launched"
    broken = {k: s.get("error") or "no startup_s" for k, s in sides.items() if not s.get("startup_s")}
    if len(sides) < 2 or broken:
        write_results(out, "startup", {"what": "launch to first step", "source": source, "sides": sides})
        print(f"startup: FAILED {broken or 'needs the ds_train and bare sides'}", flush=True)
        return 1
    results = {"what": "launch to first step, ds_train against the bare DeepSpeed loop", "source": source,
               "sides": {k: {"startup_s": s["startup_s"], "wall_s": s.get("wall_s")} for k, s in sides.items()},
               **compare(sides), "reduced": args.reduced}
    path = write_results(out, "startup", results)
    t = results["total_s"]
    print(f"launch to first step: ds_train {t['ds_train']:.1f} s, bare {t['bare']:.1f} s, difference "
          f"{results['difference_s']:+.1f} s (target <= {TARGET_S:g})")
    for row in results["phases"]:
        twin = f"bare {row['bare_phase']} {row['bare_s']:.1f}" if row["bare_phase"] else "bare: none"
        print(f"  {row['phase']:14s} {row['ds_train_s']:6.1f} s  ({twin}; excess {row['excess_s']:+.1f})")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
