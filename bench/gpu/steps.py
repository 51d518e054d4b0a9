"""The training loop on a GPU: per-step overhead, bf16 against fp32, checkpoint save / load, export.

    python bench/gpu/steps.py --out OUT
    python bench/gpu/steps.py --out OUT --reduced --data DIR      # the CPU check the suite runs

A ~124M-parameter Llama on one GPU, ZeRO-2:
  overhead   bench/overhead.py in one process (seq 1024, micro 4 x accumulation 2): ds_train's loop
             against a bare engine loop on the same engine, alternating, median ratio of tokens/s
  precision  the same run (seed, data, 60 steps) in bf16 and in fp32: the loss at every logged
             step, and the largest relative difference
  checkpoint the bf16 run saves at its last step ("saved checkpoint ... in N s" in its rank log),
             then a second `ds-train train` resumes it for 10 more steps ("loaded ... in N s")
  export     `ds-train export` of that checkpoint to a Hugging Face directory, timed
results: OUT/steps.json. --reduced runs the bf16, fp32 and resumed runs as the jobs of one process.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (LLAMA_124M, ROOT, add_common_args, ds_train, launch, launch_jobs, metrics,  # noqa: E402
                    run_config, start, tail, write_results)
from bench import cli  # noqa: E402

DS_CONFIG = str(ROOT / "ds_configs" / "zero2.json")
PARTS = ("overhead", "precision", "checkpoint", "export")


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--steps", type=int, default=60, help="steps of the precision runs (default 60)")
    return p.parse_args(argv)


def seconds_in_log(run: Path, what: str) -> float | None:
    """N from the last "<what> checkpoint step_... in N s" line of rank 0's log."""
    found = re.findall(rf"{what} checkpoint step_\d+ in ([\d.]+) s", (run / "logs" / "rank_0.log").read_text())
    return float(found[-1]) if found else None


def overhead(args, out: Path, model: dict, reduced: bool) -> dict:
    seq, micro = (64, 2) if reduced else (1024, 4)
    cfg = run_config(out, "overhead", model, args.data, seq=seq, micro=micro, global_batch=2 * micro, steps=10,
                     dtype="fp32" if reduced else "bf16", log_every=10)
    result, log = out / "overhead_raw.json", out / "logs" / "overhead.log"
    counts = ["--steps", "3", "--repeats", "2", "--warmup", "1"] if reduced else \
             ["--steps", "20", "--repeats", "5", "--warmup", "5"]
    rc, wall = launch([sys.executable, str(ROOT / "bench" / "overhead.py"), "--config", str(cfg), "--ds-config",
                       DS_CONFIG, *counts, "--out", str(result), "log.every=10"], log, args.timeout)
    if rc or not result.is_file():
        return {"error": f"exit {rc}", "log_tail": tail(log)}
    d = json.loads(result.read_text())
    return {"median_ratio": d["median_ratio"], "target": d["target"], "met": d["met"],
            "median_bare_tokens_per_s": d["median_bare_tokens_per_s"],
            "median_ds_train_tokens_per_s": d["median_ds_train_tokens_per_s"], "seq_len": seq, "micro": micro,
            "wall_s": wall}


def train_config(args, out: Path, name: str, model: dict, dtype: str, steps: int, reduced: bool) -> Path:
    seq, micro = (64, 2) if reduced else (1024, 8)
    return run_config(out, name, model, args.data, seq=seq, micro=micro, global_batch=2 * micro, steps=steps,
                      dtype=dtype, log_every=max(1, steps // 6), checkpoint={"save_final": True})


def trained(out: Path, name: str, wall: float, upto: int | None = None) -> dict:
    return {"wall_s": wall, "losses": {r["step"]: r["train/loss"] for r in metrics(out / "runs" / name)
                                       if "train/loss" in r and (upto is None or r["step"] <= upto)}}


def train(args, out: Path, name: str, steps: int, fresh: bool = True) -> dict:
    """`ds-train train` of configs/NAME.yaml to `steps` (not fresh: resuming its run)."""
    log = out / "logs" / f"{name}{'' if fresh else '_resume'}.log"
    rc, wall = launch(ds_train("train", "--config", str(out / "configs" / f"{name}.yaml"), "--ds-config", DS_CONFIG,
                               f"train.max_steps={steps}"), log, args.timeout)
    return {"error": f"exit {rc}", "log_tail": tail(log)} if rc else trained(out, name, wall)


def precision_runs(args, out: Path, model: dict, steps: int, more: int) -> tuple[dict, dict]:
    """The bf16 and fp32 runs, then bf16's resumed for `more` steps: ({dtype: run}, the resume). Each
    its own process; --reduced: the three as the jobs of one."""
    cfgs = {dtype: train_config(args, out, dtype, model, dtype, steps, args.reduced) for dtype in ("bf16", "fp32")}
    if not args.reduced:
        runs = {dtype: train(args, out, dtype, steps) for dtype in cfgs}
        return runs, (train(args, out, "bf16", steps + more, fresh=False) if "losses" in runs["bf16"] else {})
    rc, wall, log = launch_jobs(out, "precision", [("bf16", cfgs["bf16"], {}), ("fp32", cfgs["fp32"], {}),
                                                   ("bf16_resume", cfgs["bf16"], {"max_steps": steps + more})],
                                DS_CONFIG, args.timeout)
    if rc:
        failed = {"error": f"exit {rc}", "log_tail": tail(log)}
        return {dtype: failed for dtype in cfgs}, failed
    return {dtype: trained(out, dtype, wall, upto=steps) for dtype in cfgs}, trained(out, "bf16", wall)


def main(argv=None) -> int:
    args = parse_args(argv)
    out, model, _, _ = start(args, LLAMA_124M)  # its parts choose their own seq_len and dtype
    steps = min(args.steps, 6) if args.reduced else args.steps
    res: dict = {"what": "loop overhead, bf16 vs fp32, checkpoint save/load, export", "model": model,
                 "reduced": args.reduced}
    res["overhead"] = overhead(args, out, model, args.reduced)
    print(f"overhead: {res['overhead'].get('median_ratio', res['overhead'].get('error'))}", flush=True)

    runs, resumed = precision_runs(args, out, model, steps, 2 if args.reduced else 10)
    if all("losses" in r for r in runs.values()):
        b, f = runs["bf16"]["losses"], runs["fp32"]["losses"]
        rel = {s: abs(b[s] - f[s]) / abs(f[s]) for s in sorted(set(b) & set(f))}
        res["precision"] = {"steps": steps, "bf16": b, "fp32": f, "relative_difference": rel,
                            "max_relative_difference": max(rel.values()),
                            "final_relative_difference": rel[max(rel)]}
        print(f"bf16 vs fp32: largest relative loss difference {res['precision']['max_relative_difference']:.4f}",
              flush=True)
    else:
        res["precision"] = {k: v for k, v in runs.items() if "error" in v}

    run = out / "runs" / "bf16"
    if "losses" in runs["bf16"]:
        tags = sorted((run / "checkpoints").glob("step_*"))
        size = sum(p.stat().st_size for p in tags[0].rglob("*") if p.is_file()) if tags else 0
        res["checkpoint"] = {"save_s": seconds_in_log(run, "saved"), "load_s": seconds_in_log(run, "loaded"),
                             "bytes": size, "resume": "error" not in resumed}
        if "error" in resumed:
            res["checkpoint"].update(error=resumed["error"], log_tail=resumed["log_tail"])
        log = out / "logs" / "export.log"
        target = out / "export"
        shutil.rmtree(target, ignore_errors=True)
        rc, wall = launch(ds_train("export", str(run), "--out", str(target)), log, args.timeout)
        res["export"] = {"seconds": wall, "bytes": sum(p.stat().st_size for p in target.rglob("*") if p.is_file())}
        if rc:
            res["export"].update(error=f"exit {rc}", log_tail=tail(log))
        print(f"checkpoint: save {res['checkpoint']['save_s']} s, load {res['checkpoint']['load_s']} s, "
              f"{size / 2**30:.2f} GiB; export {wall:.1f} s", flush=True)
    path = write_results(out, "steps", res)
    print(f"results: {path}")
    failed = [k for k in PARTS if not isinstance(res.get(k), dict) or "error" in res[k]
              or any(isinstance(v, dict) and "error" in v for v in res[k].values())]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
