"""RIPT against continued SFT for the same wall-clock time, from the same SFT policy (2 processes).

    python bench/ript_vs_sft.py [--out runs/bench_ript] [--ds-config ds_configs/zero2.json] [overrides...]

1. SFT: recipes/ript_sft.yaml (a few demonstrations per task); skipped when already trained.
2. RIPT: recipes/ript_demo.yaml from that SFT run, timed (launcher start to exit).
3. Continued SFT: the SFT run resumed into another directory for at least as long as RIPT took
   (launcher start-ups included on both sides; topped up from its own checkpoint if short).
4. Held-out success of all three with RIPT's own evaluation (greedy, the same held-out contexts).
Prints a table and writes OUT/summary.json. Overrides (key=value) go to the RIPT run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def launch(command: str, config: str, ds_config: str, *overrides: str) -> float:
    """Run `deepspeed --num_gpus 2 --module ds_train COMMAND ...`; returns the wall time."""
    args = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--module", "ds_train",
            command, "--config", config, "--ds-config", ds_config, *overrides]
    t0 = time.perf_counter()
    subprocess.run(args, cwd=ROOT, check=True, stdout=subprocess.DEVNULL if command == "train" else None)
    return time.perf_counter() - t0


def heldout_success(model_dir: Path, cfg) -> dict:
    """The evaluation `ds_train ript` runs, in this process, for a Hugging Face directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ds_train.ript.rollout import model_policy, rollout
    from ds_train.ript.tasks import load_task

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    act = model_policy(model, tok, cfg.ript.max_new_tokens, temperature=0.0)
    wins = total = 0
    per_task = {}
    for spec in cfg.ript.tasks:
        task = load_task(spec)
        eps = rollout(act, tok, [(task, c, 0) for c in task.contexts("heldout", cfg.ript.eval_contexts, cfg.seed)],
                      cfg.ript.rollout_contexts * cfg.ript.rloo_batch_size)
        per_task[task.name] = sum(e.success for e in eps) / len(eps)
        wins, total = wins + sum(e.success for e in eps), total + len(eps)
    return {"success_rate": wins / total, "per_task": per_task}


def main() -> None:
    from ds_train.configfile import load_config
    from ds_train.export import export

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/bench_ript")
    ap.add_argument("--ds-config", default="ds_configs/zero2.json")
    ap.add_argument("overrides", nargs="*", default=[])
    args = ap.parse_args()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    out = (ROOT / args.out).resolve()
    sft, ript_dir, more = out / "sft", out / "ript", out / "sft_continued"
    launch("train", "recipes/ript_sft.yaml", args.ds_config, f"output_dir={sft}", "log.progress=false")
    ript_overrides = [f"output_dir={ript_dir}", f"model.path={sft}", *args.overrides]
    cfg = load_config(ROOT / "recipes" / "ript_demo.yaml", ript_overrides)
    ript_s = launch("ript", "recipes/ript_demo.yaml", args.ds_config, *ript_overrides)

    sft_cfg = load_config(ROOT / "recipes" / "ript_sft.yaml")
    steps = [m["perf/step_time_s"] for m in map(json.loads, (sft / "metrics.jsonl").read_text().splitlines())
             if m.get("perf/step_time_s")]
    final = sft_cfg.train.max_steps
    extra = math.ceil(ript_s / statistics.median(steps))  # launcher start-up counted as training time
    more_s = launch("train", "recipes/ript_sft.yaml", args.ds_config, f"output_dir={more}",
                    f"checkpoint.resume={sft / 'checkpoints'}", f"train.max_steps={final + extra}",
                    "log.progress=false")
    while more_s < ript_s:  # at least as long as RIPT: top up at the rate it just ran (from its checkpoint)
        extra += math.ceil((ript_s - more_s) * extra / more_s) + 1
        more_s += launch("train", "recipes/ript_sft.yaml", args.ds_config, f"output_dir={more}",
                         f"train.max_steps={final + extra}", "log.progress=false")
    rows = {}
    for name, run_dir, seconds in (("SFT (start)", sft, 0.0), ("RIPT", ript_dir, ript_s),
                                   ("SFT continued", more, more_s)):
        hf = out / f"hf_{run_dir.name}"
        if not (hf / "config.json").is_file():
            export(run_dir, hf)
        rows[name] = {"seconds": round(seconds, 1), **heldout_success(hf, cfg)}
    logged = json.loads((ript_dir / "ript_results.json").read_text())
    rows["RIPT"]["logged_by_ript"] = logged["eval"]["success_rate"]
    rows["SFT (start)"]["logged_by_ript"] = logged["evals"][0]["success_rate"]
    rows["SFT continued"]["steps"] = extra
    (out / "summary.json").write_text(json.dumps(rows, indent=2))
    tasks = list(rows["RIPT"]["per_task"])
    print(f"{'':14} {'wall s':>7} {'held-out':>9} " + " ".join(f"{t:>7}" for t in tasks))
    for name, row in rows.items():
        print(f"{name:14} {row['seconds']:>7.0f} {row['success_rate']:>9.3f} " +
              " ".join(f"{row['per_task'][t]:>7.2f}" for t in tasks))
    print(f"RIPT - SFT start: {100 * (rows['RIPT']['success_rate'] - rows['SFT (start)']['success_rate']):+.1f} points; "
          f"RIPT - SFT continued: {100 * (rows['RIPT']['success_rate'] - rows['SFT continued']['success_rate']):+.1f} points")


if __name__ == "__main__":
    main()
