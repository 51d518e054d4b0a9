"""The doctor's GPU fixtures, captured for real: a CUDA out-of-memory and a CUDA error, each through
`ds-train train` under the real deepspeed launcher on one GPU.

    python bench/gpu/capture.py --out OUT                             # on the GPU machine
    python bench/gpu/capture.py --out OUT --reduced --data DIR        # the CPU check the suite runs

  cuda_oom    the ~124M Llama at seq 2048 with a micro-batch far past any GPU's memory (--oom-micro):
              the run must end with exit 4 and the memory plan's OOM report
  cuda_error  watchdog.debug_fault=device_assert:0:3: an index out of range inside a kernel at step 3,
              the real "CUDA error: device-side assert triggered"

Each capture is kept as tests/fixtures/doctor keeps a failure: OUT/<name>/console.log (the
launcher's output) and OUT/<name>/run (the run directory, without checkpoints or weights). OUT/capture.json
holds, per capture, the command, the exit status and what `ds-train doctor` says of it, as a draft
of its MANIFEST.yaml entry (cites named as under tests/fixtures/doctor/gpu/<name>). To keep one: copy
OUT/<name> to tests/fixtures/doctor/gpu/<name> and add its entry (captured: true).

--reduced: a CPU has no device memory to run out of, so cuda_oom is skipped (said so in
capture.json); cuda_error runs and gives torch's CPU IndexError (the doctor: rank_error).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (LLAMA_124M, ROOT, _free_port, add_common_args, launch, run_config, start, tail,  # noqa: E402
                    write_results)
from bench import cli  # noqa: E402

DS_CONFIG = ROOT / "ds_configs" / "zero2.json"
# run-directory entries a fixture does not need
KEEP_OUT = ("checkpoints", "hf_model", "final", "wandb", "plots", ".ds_train.lock")
CAPTURES = ("cuda_oom", "cuda_error")


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--only", default=",".join(CAPTURES), help=f"comma-separated, from {', '.join(CAPTURES)}")
    p.add_argument("--oom-micro", type=int, default=512,
                   help="micro-batch of the OOM capture (default 512: ~1M tokens of seq 2048, logits alone "
                        "past 140 GiB)")
    args = p.parse_args(argv)
    args.only = [c.strip() for c in args.only.split(",") if c.strip()]
    if bad := [c for c in args.only if c not in CAPTURES]:
        p.error(f"--only: unknown {bad}; choose from {', '.join(CAPTURES)}")
    return args


def deepspeed_train(cfg: Path, overrides: list[str], console: Path, timeout: float) -> tuple[int, str]:
    """`deepspeed --num_gpus 1 --module ds_train train ...` (the launcher's own module, so a
    --target install of DeepSpeed without its bin/ works), its output to `console`."""
    port = str(_free_port())
    argv = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", port,
            "--module", "ds_train", "train", "--config", str(cfg), "--ds-config", str(DS_CONFIG), *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    rc, _ = launch(argv, console, timeout, env=env)
    how = " ".join(["deepspeed", *argv[3:]]).replace(str(ROOT) + "/", "")
    return rc, how


def keep(run: Path, dest: Path) -> None:
    """The run directory as a fixture keeps it: logs, records, configs; no checkpoints or weights."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(run, dest, ignore=lambda d, names: [n for n in names if Path(d) == run and n in KEEP_OUT])


def verdict(case: Path, name: str) -> list[list[dict]]:
    """What the doctor says of everything kept together, then of the run directory alone (as
    tests/test_doctor.py asks it), cites named as they will be under tests/fixtures/doctor/gpu/NAME."""
    from ds_train.observe.doctor import diagnose

    said = []
    for paths in ([str(case / "console.log"), str(case / "run")], [str(case / "run")]):
        said.append([{"cls": f.cls, "where": f.where,
                      "cites": [e.replace(f"{case}/", f"gpu/{name}/").split(": ", 1)[0] for e in f.evidence]}
                     for f in diagnose(*paths)])
    return said


def capture(args, out: Path, name: str, model: dict, seq: int, dtype: str, micro: int, overrides: list[str]) -> dict:
    case = out / name
    shutil.rmtree(case, ignore_errors=True)
    cfg = run_config(out, name, model, args.data, seq=seq, micro=micro, global_batch=micro, steps=6, dtype=dtype,
                     log_every=1)
    t0 = time.perf_counter()
    rc, how = deepspeed_train(cfg, overrides, case / "console.log", args.timeout)
    seconds = time.perf_counter() - t0
    run = out / "runs" / name
    if run.is_dir():
        keep(run, case / "run")
    result = {"exit": rc, "seconds": seconds, "how": how, "config": str(cfg.relative_to(out)),
              "console_tail": tail(case / "console.log", 12)}
    if (case / "run").is_dir():
        result["doctor"] = verdict(case, name)
        first = result["doctor"][0][0] if result["doctor"][0] else None
        result["expect"] = first["cls"] if first else "none"
        if first:  # the line that tells the class: the first the doctor cites
            path, _, line = first["cites"][0].partition(":")
            file = case / path.removeprefix(f"gpu/{name}/") if path.startswith("gpu/") else case / "run" / path
            if line.isdigit() and file.is_file():
                result["key"] = file.read_text(errors="replace").splitlines()[int(line) - 1].strip()[:300]
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    out, model, seq, dtype = start(args, LLAMA_124M)
    results: dict = {"what": "doctor fixtures captured through ds_train", "reduced": args.reduced, "captures": {}}
    for name in args.only:
        if name == "cuda_oom" and args.reduced:
            results["captures"][name] = {"skipped": "a CPU has no device memory to run out of"}
            continue
        micro, overrides = (args.oom_micro, []) if name == "cuda_oom" else \
            (2, ["watchdog.debug_fault=device_assert:0:3"])
        r = results["captures"][name] = capture(args, out, name, model, seq, dtype, micro, overrides)
        print(f"{name}: exit {r['exit']} in {r['seconds']:.0f} s; doctor: {r.get('expect', '?')}"
              + (f"; key: {r['key'][:160]}" if r.get("key") else ""), flush=True)
    path = write_results(out, "capture", results)
    print(f"results: {path}")
    # On a GPU the device-side assert leaves CUDA unusable and the NCCL watchdog aborts the process
    # (SIGABRT), which the DeepSpeed runner reports as 250 (H200, 2026-11-26); a CPU raises IndexError.
    wanted = {"cuda_oom": (4, "cuda_oom"), "cuda_error": (1, "rank_error") if args.reduced else (250, "cuda_error")}
    ok = all(r.get("skipped") or (r["exit"], r.get("expect")) == wanted[n] for n, r in results["captures"].items())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(cli.run(main))
