"""The README's RIPT demo, run as written, against continued SFT for the same wall time; rewrites
the README's and BENCHMARKS.md's RIPT figures from what it measured.

    python bench/ript_vs_sft.py [--replace] [--no-write]

1. SFT, the README's command: `deepspeed --num_gpus 2 --module ds_train train --config
   recipes/ript_sft.yaml --ds-config ds_configs/zero2.json` (into runs/ript_sft).
2. RIPT, the README's command: `deepspeed --num_gpus 2 --module ds_train ript --config
   recipes/ript_demo.yaml --ds-config ds_configs/zero2.json` (into runs/ript_demo); the line it
   prints last ("held-out success A (iteration 0) -> B (iteration N)") is the README's figure.
3. Continued SFT: runs/ript_sft resumed into runs/bench_ript/sft_continued for at least as long as
   RIPT took (launcher start-ups included on both sides; topped up from its own checkpoint if short).
4. Held-out success per task of all three with RIPT's own evaluation (greedy, the same contexts).

runs/ript_sft, runs/ript_demo and runs/bench_ript must not exist (the commands would resume them):
--replace removes them, and the SFT data prepared in data/cache/ript_demos, first. Writes
runs/bench_ript/summary.json and, unless --no-write, the marked blocks of README.md and
BENCHMARKS.md (date, machine, versions, commands, numbers).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SFT_CMD = "deepspeed --num_gpus 2 --module ds_train train --config recipes/ript_sft.yaml --ds-config ds_configs/zero2.json"
RIPT_CMD = "deepspeed --num_gpus 2 --module ds_train ript --config recipes/ript_demo.yaml --ds-config ds_configs/zero2.json"
SFT_DIR, RIPT_DIR, OUT = ROOT / "runs" / "ript_sft", ROOT / "runs" / "ript_demo", ROOT / "runs" / "bench_ript"
DATA_DIR = ROOT / "data" / "cache" / "ript_demos"  # recipes/ript_sft.yaml's data.dir, prepared by its first run
REPORTED = re.compile(r"held-out success (\d\.\d{3}) \(iteration 0\) -> (\d\.\d{3}) \(iteration (\d+)\)")


def run(command: str, *overrides: str, log: Path) -> tuple[float, str]:
    """Run a README command (plus overrides) from the repository root, its output teed to `log`;
    returns the wall time and the output."""
    args = command.split() + list(overrides)
    args[0] = str(Path(sys.executable).parent / args[0])  # the venv's launcher
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = time.perf_counter() - t0
    log.write_text(proc.stdout)
    if proc.returncode:
        sys.exit(f"bench: `{' '.join([command, *overrides])}` failed (exit {proc.returncode}); see {log}")
    return seconds, proc.stdout


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


def continued_sft(ript_s: float) -> tuple[float, int]:
    """SFT resumed from runs/ript_sft for at least ript_s seconds; returns (seconds, extra steps)."""
    from ds_train.configfile import load_config

    final = load_config(ROOT / "recipes" / "ript_sft.yaml").train.max_steps
    steps = [m["perf/step_time_s"] for m in map(json.loads, (SFT_DIR / "metrics.jsonl").read_text().splitlines())
             if m.get("perf/step_time_s")]
    extra = math.ceil(ript_s / statistics.median(steps))  # launcher start-up counted as training time
    more = OUT / "sft_continued"
    common = (f"output_dir={more}", "log.progress=false")
    more_s, _ = run(SFT_CMD, *common, f"checkpoint.resume={SFT_DIR / 'checkpoints'}", f"train.max_steps={final + extra}",
                    log=OUT / "sft_continued.log")
    while more_s < ript_s:  # at least as long as RIPT: top up at the rate it just ran (from its checkpoint)
        extra += math.ceil((ript_s - more_s) * extra / more_s) + 1
        more_s += run(SFT_CMD, *common, f"train.max_steps={final + extra}", log=OUT / "sft_continued.log")[0]
    return more_s, extra


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, no GPU"


def versions() -> str:
    import deepspeed
    import torch
    import transformers
    return f"torch {torch.__version__}, DeepSpeed {deepspeed.__version__}, transformers {transformers.__version__}"


def tables(s: dict) -> tuple[str, str]:
    """(the README's paragraph, BENCHMARKS.md's section body) from the summary."""
    rows, tasks = s["rows"], list(s["rows"]["RIPT"]["per_task"])
    start, end, more = (rows[k]["success_rate"] for k in ("SFT (start)", "RIPT", "SFT continued"))
    head = "| policy | wall s | held-out success | " + " | ".join(tasks) + " |\n|---|---|---|" + "---|" * len(tasks)
    lines = [head] + [f"| {name} | {row['seconds']:.0f} | {row['success_rate']:.3f} | " +
                      " | ".join(f"{row['per_task'][t]:.2f}" for t in tasks) + " |" for name, row in rows.items()]
    printed = s["printed"]
    readme = (f"Measured on this 2-core CPU ({s['date']}, 2 processes, ZeRO-2, fp32; `python bench/ript_vs_sft.py` "
              f"runs the two commands above as written and writes these figures): the RIPT command prints "
              f"\"held-out success {printed[0]} (iteration 0) -> {printed[1]} (iteration {printed[2]})\", "
              f"**{100 * (end - start):+.1f} points** over the SFT start (greedy, {s['eval_contexts']} held-out "
              f"contexts per task, all seven tasks), in {s['sft_s'] + s['ript_s']:.0f} s for both commands "
              f"(SFT {s['sft_s']:.0f} s, RIPT {s['ript_s']:.0f} s, start-ups included). SFT continued for "
              f"{rows['SFT continued']['seconds']:.0f} s instead reaches {more:.3f} ({100 * (end - more):+.1f} points "
              f"for RIPT). Per task:\n\n" + "\n".join(lines) + "\n")
    bench = (f"- Date: {s['date']}. Machine: {s['machine']}; {s['versions']}.\n"
             f"- Commands (the README's, as written): `{SFT_CMD}` ({s['sft_s']:.0f} s), then `{RIPT_CMD}` "
             f"({s['ript_s']:.0f} s; it printed \"held-out success {printed[0]} (iteration 0) -> {printed[1]} "
             f"(iteration {printed[2]})\"); continued SFT: the first command resumed from runs/ript_sft for "
             f"{s['rows']['SFT continued']['steps']} more steps. All by `python bench/ript_vs_sft.py`, which "
             f"wrote this section.\n"
             f"- Held-out success: greedy, {s['eval_contexts']} held-out contexts per task, the evaluation "
             f"`ds_train ript` logs (recomputed in-process from each exported model; the RIPT column's start and "
             f"end equal what the command printed).\n\n" + "\n".join(lines) + "\n\n"
             f"RIPT - SFT start: **{100 * (end - start):+.1f} points**; RIPT - SFT continued for the same wall "
             f"time: **{100 * (end - more):+.1f} points**.\n")
    return readme, bench


def rewrite(path: Path, name: str, text: str) -> None:
    """Replace the block between `<!-- NAME:start -->` and `<!-- NAME:end -->` in path."""
    begin, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
    doc = path.read_text()
    i, j = doc.index(begin) + len(begin), doc.index(end)
    path.write_text(doc[:i] + text + doc[j:])


def main() -> None:
    from ds_train.configfile import load_config
    from ds_train.export import export

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replace", action="store_true", help="remove runs/ript_sft, runs/ript_demo, runs/bench_ript "
                                                           "and data/cache/ript_demos first")
    ap.add_argument("--no-write", action="store_true", help="leave README.md and BENCHMARKS.md as they are")
    args = ap.parse_args()
    held = [str(p.relative_to(ROOT)) for p in (SFT_DIR, RIPT_DIR, OUT) if p.exists()]
    if held and not args.replace:
        sys.exit(f"bench: {', '.join(held)} exist: the README's commands would resume them; give --replace "
                 f"to remove them first")
    for p in (SFT_DIR, RIPT_DIR, OUT, DATA_DIR):
        shutil.rmtree(p, ignore_errors=True)
    OUT.mkdir(parents=True)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    sft_s, _ = run(SFT_CMD, log=OUT / "sft.log")
    ript_s, out = run(RIPT_CMD, log=OUT / "ript.log")
    printed = REPORTED.findall(out)[-1]
    more_s, extra = continued_sft(ript_s)

    cfg = load_config(ROOT / "recipes" / "ript_demo.yaml")
    rows = {}
    for name, run_dir, seconds in (("SFT (start)", SFT_DIR, 0.0), ("RIPT", RIPT_DIR, ript_s),
                                   ("SFT continued", OUT / "sft_continued", more_s)):
        hf = OUT / f"hf_{run_dir.name}"
        export(run_dir, hf)
        rows[name] = {"seconds": round(seconds, 1), **heldout_success(hf, cfg)}
    rows["SFT continued"]["steps"] = extra
    for name, value in (("SFT (start)", printed[0]), ("RIPT", printed[1])):
        assert f"{rows[name]['success_rate']:.3f}" == value, (name, rows[name]["success_rate"], value)
    summary = {"date": datetime.date.today().isoformat(), "machine": machine(), "versions": versions(),
               "sft_s": round(sft_s, 1), "ript_s": round(ript_s, 1), "printed": list(printed),
               "eval_contexts": cfg.ript.eval_contexts, "rows": rows}
    (OUT / "summary.json").write_text(json.dumps(summary, indent=2))
    readme, bench = tables(summary)
    print(bench)
    if not args.no_write:
        rewrite(ROOT / "README.md", "ript-bench", readme)
        rewrite(ROOT / "BENCHMARKS.md", "ript-bench", bench)
        print("rewrote the ript-bench blocks of README.md and BENCHMARKS.md")


if __name__ == "__main__":
    main()
