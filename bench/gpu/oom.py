"""The out-of-memory path for real: a micro-batch the planner says does not fit, then its fix.

    python bench/gpu/oom.py --out OUT
    python bench/gpu/oom.py --out OUT --reduced --data DIR      # the CPU check the suite runs

The ~1B Llama of mfu.py (seq 2048, bf16, ZeRO-2, one GPU). The planner (`ds-train estimate`'s
arithmetic, for this GPU's memory) gives the smallest power-of-two micro-batch that does not fit;
`ds-train train` with it must end with exit 4 and the OOM report; the first change the report
marks "fits" is applied and run next, and must finish (exit 0) with its measured peak under the
GPU's memory. If the "does not fit" micro-batch runs after all (the planner is too pessimistic),
that is recorded and the next one up is tried.

--reduced: a CPU has no device-memory limit, so no real OOM happens. The planner is given a
memory it calls too small for the micro-batch, the run is recorded as finishing, and the fix is
taken from the report that `ds_train.plan.planner.oom_report` (the function the OOM path prints) writes for
that run; the fix's run then checks the rest of the script.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (LLAMA_1B, ROOT, add_common_args, ds_train, launch, metrics,  # noqa: E402
                    run_config, start, tail, write_results)
from bench import cli  # noqa: E402

DS_CONFIG = ROOT / "ds_configs" / "zero2.json"
FIX = re.compile(r"^\s*([\d.]+) GiB fits\s+(.+)$")
STEPS = 3


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--gpu-memory", type=float, help="GiB (default: nvidia-smi's total for GPU 0)")
    return p.parse_args(argv)


def gpu_memory_gib() -> float:
    """Without creating a CUDA context in this process (it would hold memory the runs need)."""
    got = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return float(got.strip().splitlines()[0]) / 1024


def planner(cfg_path: Path, memory: float) -> dict:
    """The given row of the estimate (ZeRO-2, this micro-batch) for one GPU of `memory` GiB."""
    from ds_train.config.file import load_config
    from ds_train.estimate import run_estimate
    from ds_train.plan.planner import Target

    out = run_estimate(load_config(cfg_path), str(DS_CONFIG), Target(1, 1, memory), None)
    return next(r for r in out["rows"] if r["given"])


def fix_from(report: str) -> tuple[str, list[str]]:
    """The first change marked "fits": (ds_config path, overrides)."""
    for line in report.splitlines():
        m = FIX.match(line)
        if m:
            change = m.group(2).split(" (")[0].strip()
            if change.startswith("--ds-config "):
                return str(ROOT / change.split()[1]), []
            return str(DS_CONFIG), change.split()
    raise cli.fail(f"no change marked 'fits' in the OOM report ({cli.saved_output(report, 'oom_report')})")


def train(out: Path, name: str, cfg: Path, ds_config: str, overrides: list[str], timeout: float) -> dict:
    log = out / "logs" / f"{name}.log"
    rc, wall = launch(ds_train("train", "--config", str(cfg), "--ds-config", ds_config, *overrides), log, timeout)
    recs = [r for r in metrics(out / "runs" / name) if "mem/max_rank_gib" in r]
    return {"exit": rc, "wall_s": wall, "ds_config": ds_config, "overrides": overrides, "log": str(log),
            "peak_gib": max((r["mem/max_rank_gib"] for r in recs), default=None), "log_tail": tail(log, 25)}


def main(argv=None) -> int:
    args = parse_args(argv)
    out, model, seq, dtype = start(args, LLAMA_1B)

    @functools.cache  # written once: run_config empties the run directory
    def config(micro: int, suffix: str = "") -> Path:
        return run_config(out, f"oom_m{micro}{suffix}", model, args.data, seq=seq, micro=micro,
                          global_batch=4 * micro, steps=STEPS, dtype=dtype)

    if args.reduced:  # a memory the planner calls too small for micro-batch 2, not for 1
        from ds_train.plan.planner import USABLE

        rows = {m: planner(config(m), 1e6)["gpu_peak_gib"] for m in (1, 2)}
        memory = (rows[1] + rows[2]) / 2 / USABLE
    else:
        memory = args.gpu_memory or gpu_memory_gib()
    result: dict = {"what": "OOM report and its fix", "model": model, "seq_len": seq, "gpu_memory_gib": memory,
                    "reduced": args.reduced, "attempts": []}
    micro = 1
    while planner(config(micro), memory)["fits"]:
        micro *= 2
        if micro > 4096:
            raise SystemExit("the planner says every micro-batch up to 4096 fits: nothing to test")
    for _ in range(2):
        row = planner(config(micro), memory)
        attempt = {"micro_batch_size": micro, "predicted_gib": row["gpu_peak_gib"],
                   **train(out, f"oom_m{micro}", config(micro), str(DS_CONFIG), [], args.timeout)}
        result["attempts"].append(attempt)
        print(f"micro-batch {micro}: predicted {row['gpu_peak_gib']:.2f} GiB of {memory:.2f} -> exit {attempt['exit']}",
              flush=True)
        if attempt["exit"] == 4 or args.reduced:
            break
        micro *= 2  # it fitted after all: the planner is too pessimistic here; one more try
    attempt = result["attempts"][-1]
    if attempt["exit"] == 4:
        report = Path(attempt["log"]).read_text(errors="replace")
        result["oom_report"] = report[report.find("out of GPU memory"):][:4000]
    elif args.reduced and attempt["exit"] == 0:
        from transformers import AutoConfig

        from ds_train.config.file import load_config
        from ds_train.plan.planner import oom_report

        run = out / "runs" / f"oom_m{micro}"
        report = oom_report(load_config(config(micro)), json.loads((run / "ds_config.json").read_text()),
                            AutoConfig.from_pretrained(run / "hf_model"), 1, memory)
        result["oom_report"] = report
    else:
        print(f"FAILED: micro-batch {micro} ended with exit {attempt['exit']}, not 4:\n{attempt['log_tail']}")
        write_results(out, "oom", result)
        return 1
    ds_config, overrides = fix_from(result["oom_report"])
    fixed = train(out, f"oom_m{micro}_fix", config(micro, "_fix"), ds_config, overrides, args.timeout)
    result["fix"] = {"change": [ds_config, *overrides], **fixed}
    ok = fixed["exit"] == 0 and (args.reduced or (fixed["peak_gib"] or 0) < memory)
    result["verified"] = ok
    path = write_results(out, "oom", result)
    print(f"fix {' '.join(overrides) or Path(ds_config).name}: exit {fixed['exit']}, peak "
          f"{fixed['peak_gib'] if fixed['peak_gib'] is not None else float('nan'):.2f} GiB -> "
          f"{'verified' if ok else 'FAILED'}\nresults: {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(cli.run(main))
