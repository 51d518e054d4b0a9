"""One GPU lease, one command: the bench/gpu parts in the order the GPU issue needs them, each only if
it fits the time left, everything packed into one archive.

    source bench/gpu/env.sh && python3 bench/gpu/lease.py --out $OUT --work /tmp/lw   # on the GPU machine
    python bench/gpu/lease.py --out OUT --reduced --data DIR --parts capture      # the CPU check

The device tool lends a session 15 minutes of a GPU in all (the machine's start included), at most
10 minutes a command, and brings back at most 8 files from $OUT. So one command runs the parts in
order; a part starts only if its estimated seconds (ESTIMATE: a guess for one H200 until a lease
measures it; lease.json records each part's real seconds) fit in what is left of --budget, and runs
with the rest of the budget as its limit. A part that fails or is skipped is recorded and the next
one runs. Parts (--parts chooses and orders them):

  mfu       mfu.py --sides ds_train,bare,hf: tokens/s and MFU of the ~1B Llama, ds_train (its defaults:
            compiled layers) against a bare DeepSpeed loop and the HF Trainer; each side's start-up clocked
  startup   startup.py: launch to first step, ds_train against the bare loop, phase by phase (from the
            mfu part's sides when it ran, else its own two launches)
  mfu_more  mfu.py --sides liger,liger_max: Liger's kernels with compiled layers, at micro-batch 8 and at
            the largest the memory plan says fits with the memory they free
  compiled  compiled.py: compiled layers under activation checkpointing, LoRA and DPO: the plan against
            the measured peak, and losses against eager
  mfu_other mfu.py --sides eager,fused_loss,ckpt: ds_train not compiled, with the fused loss, with
            activation checkpointing
  memory    memory.py: predicted against measured peak, micro-batch 4 / 16 x ZeRO-2 / 3 x checkpointing
            off / on
  steps     steps.py: loop overhead, bf16 against fp32, checkpoint save / load, export
  oom       oom.py: a micro-batch the planner says does not fit ends with exit 4; its fix runs
  capture   capture.py: a real CUDA OOM and a real CUDA error through ds_train, kept as doctor fixtures
  rollouts  ../rollouts.py --engine vllm: rollouts/s of ds_train's vLLM engine against batched generate

OUT/lease.tar.gz holds every part's directory (results JSON, logs, configs, the captured fixtures;
no checkpoints or weights), OUT/lease.json the summary, OUT/lease.log what every part printed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_DATA, versions  # noqa: E402
from bench import cli  # noqa: E402

HERE = Path(__file__).resolve().parent
# part -> (script and its arguments, seconds on one GPU: measured on 2026-11-26 (H200, then H100))
PARTS: dict[str, tuple[list[str], int]] = {
    # 540 s on an H100 for six sides, 20 timed steps each: 64 to 114 s a side, ds_train's start-up ~60 s
    # before the start-up fix (one construction draw instead of two: ~20 s less on the ~1B model)
    "mfu": (["mfu.py", "--sides", "ds_train,bare,hf", "--warmup", "4", "--steps", "20"], 230),  # 212 s (H200, 11-28)
    # the sides' own clocks (mfu.py records them): nothing launched when the mfu part ran
    "startup": (["startup.py", "--from-mfu", "{work}/mfu/mfu.json"], 100),
    "mfu_more": (["mfu.py", "--sides", "liger,liger_max", "--warmup", "4", "--steps", "10"], 170),
    "compiled": (["compiled.py"], 170),  # 148 s (H200, 11-28)
    "mfu_other": (["mfu.py", "--sides", "eager,fused_loss,ckpt", "--warmup", "4", "--steps", "20"], 280),
    "memory": (["memory.py", "--ckpt", "off,on"], 210),  # 205 s (H200)
    "steps": (["steps.py", "--steps", "30"], 150),  # 146 s (H200)
    "oom": (["oom.py"], 200),  # 93 s with its fix failing fast (H200); 190 s with a fix that trains (H100)
    "capture": (["capture.py"], 70),  # 66 s (H200)
    # vLLM's rollouts against batched generate (bench/rollouts.py); the host needs vLLM (pip install
    # 'ds_train[vllm]': its wheel is above what a lease carries), else the part says so and fails
    "rollouts": (["../rollouts.py", "--engine", "vllm"], 120),
}
SKIP_IN_ARCHIVE = ("checkpoints", "hf_model", "export", "final", "wandb")  # directories of weights and states
TAG = "DS_TRAIN_LEASE_PART"  # in the environment of every process a part starts
MAX_FILE = 4 << 20  # bytes: a bigger file (weights, a core) stays out of the archive


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory ($OUT on the device machine)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, in order (default {','.join(PARTS)})")
    p.add_argument("--budget", type=float, default=560,
                   help="seconds for all parts together (default 560: a 600 s command, with time to pack)")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="prepared data directory (default: the bundled corpus)")
    p.add_argument("--work", help="where the parts write (default OUT/work; on the device machine outside $OUT, "
                   "whose every file is sent back)")
    p.add_argument("--reduced", action="store_true", help="every part on this CPU with a tiny model: measures nothing")
    args = p.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if bad := [x for x in args.parts if x not in PARTS]:
        p.error(f"--parts: unknown {bad}; choose from {', '.join(PARTS)}")
    if args.budget <= 0:
        p.error("--budget must be positive")
    return args


def reap(tag: str) -> int:
    """SIGKILL every process that carries this part's tag in its environment: the scripts start their
    runs in new sessions, which a kill of the part's own group would miss (and the device machine
    leaves running after the command returns). Returns how many."""
    killed = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if f"{TAG}={tag}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)
                killed += 1
        except (OSError, ProcessLookupError):
            continue
    return killed


def run_part(argv: list[str], log, limit: float, tag: str) -> int:
    """The part's script in its own session; its output to `log` (and this console); it and every
    process it started are killed past `limit`."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", TAG: tag})
    deadline = time.monotonic() + limit

    def stop(*_):
        reap(tag)

    signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, max(limit, 0.1))
    try:
        for line in proc.stdout:
            log.write(line)
            log.flush()
            print(line, end="", flush=True)
        rc = proc.wait()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        reap(tag)  # anything it left behind
    return 124 if time.monotonic() >= deadline and rc < 0 else rc


def pack(work: Path, archive: Path) -> int:
    """Every part's directory into one .tar.gz (a file the device tool brings back), without weights."""
    def keep(info: tarfile.TarInfo):
        parts = Path(info.name).parts
        if any(p in SKIP_IN_ARCHIVE or p.startswith("global_step") for p in parts):
            return None
        return None if info.isfile() and info.size > MAX_FILE else info

    with tarfile.open(archive, "w:gz") as tar:
        tar.add(work, arcname="lease", filter=keep)
    return archive.stat().st_size


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    work = Path(args.work).resolve() if args.work else out / "work"
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    summary: dict = {"what": "bench/gpu in one lease", "budget_s": args.budget, "reduced": args.reduced,
                     "versions": versions(), "parts": {}}
    with open(out / "lease.log", "w") as log:
        for name in args.parts:
            script, estimate = PARTS[name]
            left = args.budget - (time.monotonic() - t0)
            if estimate > left:
                summary["parts"][name] = {"skipped": f"needs ~{estimate} s, {left:.0f} s left"}
                print(f"== {name}: skipped (needs ~{estimate} s, {left:.0f} s left)", flush=True)
                continue
            argv = [sys.executable, str(HERE / script[0]), *[a.replace("{work}", str(work)) for a in script[1:]],
                    "--out", str(work / name),
                    "--data", args.data, "--timeout", str(int(left))] + (["--reduced"] if args.reduced else [])
            print(f"== {name}: {' '.join(script)} ({left:.0f} s left)", flush=True)
            log.write(f"== {name}: {' '.join(argv)}\n")
            start = time.monotonic()
            rc = run_part(argv, log, left, f"{os.getpid()}-{name}")
            results = sorted(str(p.relative_to(work)) for p in (work / name).glob("*.json")
                             if p.name != "versions.json")
            summary["parts"][name] = {"exit": rc, "seconds": round(time.monotonic() - start, 1),
                                      "estimate_s": estimate, "results": results}
            print(f"== {name}: exit {rc} in {summary['parts'][name]['seconds']:.0f} s", flush=True)
    summary["seconds"] = round(time.monotonic() - t0, 1)
    (out / "lease.json").write_text(json.dumps(summary, indent=2) + "\n")
    size = pack(work, out / "lease.tar.gz")
    print(f"lease: {summary['seconds']:.0f} s; " + "; ".join(
        f"{n} " + (f"exit {p['exit']} ({p['seconds']:.0f} s)" if "exit" in p else "skipped")
        for n, p in summary["parts"].items()) + f"; {out / 'lease.tar.gz'} ({size / 2**20:.1f} MiB)", flush=True)
    return 0 if all(p.get("exit") == 0 for p in summary["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(cli.run(main))
