"""The longest sequence that trains under a per-rank memory cap, with Ulysses sequence parallelism
(parallel.sequence=2 on 2 ranks) and without it (parallel.sequence=1 on 1 rank), on
recipes/long_context.yaml's model; then tokens/s of both at a length both fit.

    python bench/long_context.py [--cap-gib 1.3] [--config recipes/long_context.yaml] \
        [--ds-config ds_configs/zero2.json] [--start 4096] [--grain 1024] [--steps 2] [--repeats 2] \
        [--out FILE.json] [key=value overrides]

The cap: each rank runs in its own memory cgroup (cgroup v1 `memory.limit_in_bytes`, the kernel's
OOM killer ends a rank that goes over it, as a GPU's memory ends a CUDA run; run as root, with no
swap). A `sitecustomize.py` on PYTHONPATH moves each rank (RANK is set by the deepspeed launcher)
into `rank_<RANK>/` of a fresh cgroup per trial; the launcher itself stays outside. A trial is the
real command, `deepspeed --num_gpus N --module ds_train train ...` for `--steps` steps at one
train.seq_len; it trains if it exits 0. A trial that fails for any other reason than a rank killed
by the cap stops the bench with its last lines (so that a broken config is never reported as a
length that does not fit).

Search, per side: seq_len doubles from --start while trials train, then bisection between the
longest that trained and the shortest that did not, to --grain tokens. Then both sides run at the
longest length SP=1 trained (more steps, no cap, the sides in turn --repeats times) for tokens/s:
the median of perf/tokens_per_s after the first step, each side's best run; SP=2 also without
ds_train's tiles (the loss and MLP whole, as the other side computes them); beside them the Hugging
Face Trainer's own DeepSpeed sequence parallelism (Accelerate's ParallelismConfig,
bench/hf_sequence_parallel.py) on the same model, length and steps. The ratio longest(SP=2) /
longest(SP=1) is the figure (target >= 1.8).

The CPU's allocator: glibc's malloc raises its mmap threshold each time a large block is freed, so
later activations of that size come from the heap and stay resident after they are freed. On this
machine that retention was 0.41 of a rank's 1.17 GiB peak above baseline at SP=1 and 8,192 tokens
(anonymous memory), and it grew with the whole sequence rather than a rank's part of it: at SP=2 and
16,384 tokens (the same 8,192 a rank) the peak was 1.45 GiB, though autograd saved exactly half as
much per rank as at SP=1 (ds_train/plan/memory.py's terms all divide by the SP size). A GPU has its own
caching allocator, so every rank fixes glibc's M_MMAP_THRESHOLD (mallopt, from the bench's
sitecustomize; --malloc-mmap-threshold, default 64 KiB; 0 keeps glibc's dynamic threshold) in the
capped trials: large blocks are then mapped and returned on free, and the cap measures what the run
holds (the peaks above: 0.78 and 0.79 GiB). The speed runs keep glibc's default.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import cli  # noqa: E402

CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")
TARGET = 1.8
GiB = 2**30
SITECUSTOMIZE = '''import os
_root, _rank = os.environ.get("DS_TRAIN_BENCH_CGROUP"), os.environ.get("RANK")
if _root and _rank is not None:
    with open(os.path.join(_root, "rank_" + _rank, "cgroup.procs"), "w") as _f:
        _f.write(str(os.getpid()))
_threshold = int(os.environ.get("DS_TRAIN_BENCH_MMAP_THRESHOLD") or 0)
if _threshold and _rank is not None:  # glibc's M_MMAP_THRESHOLD, in the ranks alone
    import ctypes
    ctypes.CDLL("libc.so.6").mallopt(-3, _threshold)
'''


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "recipes" / "long_context.yaml"))
    p.add_argument("--ds-config", default=str(ROOT / "ds_configs" / "zero2.json"))
    p.add_argument("--cap-gib", type=float, default=1.3, help="memory cap per rank in GiB (default 1.3)")
    p.add_argument("--start", type=int, default=4096, help="first seq_len tried (default 4096)")
    p.add_argument("--grain", type=int, default=1024, help="bisection stops at this many tokens (default 1024)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per search trial (default 2: the second runs with the optimizer states allocated)")
    p.add_argument("--speed-steps", type=int, default=6, help="steps of the tokens/s runs (default 6)")
    p.add_argument("--repeats", type=int, default=2, help="tokens/s runs per side, in turn (default 2)")
    p.add_argument("--max-len", type=int, default=262144, help="stop doubling here (default 262144)")
    p.add_argument("--malloc-mmap-threshold", type=int, default=65536,
                   help="glibc's M_MMAP_THRESHOLD in every rank of the capped trials (default 65536; 0: glibc's "
                        "dynamic threshold)")
    p.add_argument("--out", help="also write the results as JSON here")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="run config overrides")
    args = p.parse_args(argv)
    if args.start % (2 * args.grain) and args.start % args.grain:
        p.error("--start must be a multiple of --grain")
    if not CGROUP_MEMORY.is_dir() or not os.access(CGROUP_MEMORY, os.W_OK):
        p.error(f"{CGROUP_MEMORY} is not a writable cgroup v1 memory controller (run as root on cgroup v1)")
    return args


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path):
        self.args, self.work = args, work
        self.site = work / "site"
        self.site.mkdir()
        (self.site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.trials: list[dict] = []

    def trial(self, sp: int, seq_len: int, steps: int, capped: bool = True, extra: tuple = ()) -> dict:
        """One launch at seq_len (under the cap, or with none: a speed run): trained or killed, the
        ranks' peak memory, tokens/s."""
        name = f"sp{sp}_{seq_len}_{len(self.trials)}"
        group = CGROUP_MEMORY / f"ds_train_bench_{os.getpid()}_{name}"
        ranks = [group / f"rank_{r}" for r in range(sp)]
        for g in (group, *ranks):
            g.mkdir()
        for g in ranks if capped else ():
            (g / "memory.limit_in_bytes").write_text(str(int(self.args.cap_gib * GiB)))
        run_dir = self.work / name
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(sp), "--master_port",
               str(free_port()), "--module", "ds_train", "train", "--config", self.args.config,
               "--ds-config", self.args.ds_config, *self.args.overrides, *extra, f"output_dir={run_dir}",
               f"train.seq_len={seq_len}", f"parallel.sequence={sp}", f"train.max_steps={steps}",
               "checkpoint.every=0", "checkpoint.save_final=false", "log.plots=false",
               f"model.config.max_position_embeddings={max(seq_len, 2048)}"]
        env = {**malloc_env(self.args if capped else None), "DS_TRAIN_BENCH_CGROUP": str(group),
               "WANDB_MODE": "offline",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(self.site), os.environ.get("PYTHONPATH")]))}
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        peaks = [int((g / "memory.max_usage_in_bytes").read_text()) / GiB for g in ranks]
        kills = [_oom_kills(g) for g in ranks]
        for g in (*ranks, group):
            _remove_cgroup(g)
        rates = _rates(run_dir / "metrics.jsonl")
        out = {"sp": sp, "seq_len": seq_len, "steps": steps, "capped": capped, "trained": proc.returncode == 0,
               "exit": proc.returncode, "oom_kills": kills, "peak_gib_per_rank": peaks, "seconds": seconds,
               "tokens_per_s": statistics.median(rates[1:]) if len(rates) > 1 else None}
        self.trials.append(out)
        said = "trains" if out["trained"] else f"does not fit (OOM kills per rank {kills})"
        rate = f"; {out['tokens_per_s']:,.0f} tokens/s" if out["tokens_per_s"] and not capped else ""
        print(f"  sp {sp} seq_len {seq_len:>6}: {said}; peak {', '.join(f'{p:.2f}' for p in peaks)} GiB per rank "
              f"({f'cap {self.args.cap_gib:g}' if capped else 'no cap'}); {seconds:.0f} s{rate}", flush=True)
        if not out["trained"] and not any(kills):
            log = cli.saved_output(proc.stdout + proc.stderr, name)
            raise cli.fail(f"sp {sp} seq_len {seq_len} failed without hitting the cap (exit {proc.returncode}); its "
                           f"output: {log}")
        shutil.rmtree(run_dir, ignore_errors=True)
        return out

    def longest(self, sp: int) -> int:
        """Doubling, then bisection to the grain: the longest seq_len that trains at `sp`."""
        grain, good, bad = self.args.grain, 0, 0
        length = self.args.start
        while length <= self.args.max_len:
            if self.trial(sp, length, self.args.steps)["trained"]:
                good, length = length, length * 2
            else:
                bad = length
                break
        if not good:
            raise cli.fail(f"sp {sp} does not train even at --start {self.args.start}; lower it or raise --cap-gib")
        while bad and bad - good > grain:
            mid = (good + bad) // 2 // grain * grain
            if self.trial(sp, mid, self.args.steps)["trained"]:
                good = mid
            else:
                bad = mid
        return good


# DeepSpeed's CPU ops for the HF Trainer's runs: a directory of their own. Sharing one with ds_train's runs,
# each command rebuilt the shared-memory op the other had built (two build hashes alternating in its ninja
# log, 2026-11-26), an HF run once during another's timing; kept between runs of this bench.
HF_EXTENSIONS = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ds_train" / "bench_hf_extensions"


def hf_trainer(args: argparse.Namespace, seq_len: int, work: Path, steps: int | None = None) -> dict:
    """The HF Trainer's own DeepSpeed sequence parallelism, 2 ranks, the same model, length and
    steps (bench/hf_sequence_parallel.py); no cap (only its speed is compared)."""
    out = work / "hf.json"
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           str(ROOT / "bench" / "hf_sequence_parallel.py"), "--config", args.config, "--seq-len", str(seq_len),
           "--steps", str(steps or args.speed_steps), "--out", str(out)]
    env = {**os.environ, "WANDB_MODE": "offline", "TORCH_EXTENSIONS_DIR": str(HF_EXTENSIONS)}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode or not out.is_file():
        last = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()][-1:]
        return {"error": f"exit {proc.returncode}: {last[0] if last else ''}"}
    result = json.loads(out.read_text())
    print(f"  hf trainer sp 2 seq_len {seq_len:>6}: {result['tokens_per_s']:,.0f} tokens/s", flush=True)
    return result


# The speed runs' ds_train sides: (parallel.sequence, overrides). The HF Trainer computes the whole
# logits and MLP at once; ds_train tiles them by default (train.loss_tile_tokens, mlp_tile_positions),
# recomputing each tile in the backward: the untiled side says what that costs.
SPEED_SIDES = {"sp1": (1, ()), "sp2": (2, ()),
               "sp2_untiled": (2, ("train.loss_tile_tokens=0", "train.mlp_tile_positions=0"))}


def malloc_env(args: argparse.Namespace | None) -> dict:
    """The environment of a trial: this one, with glibc's mmap threshold fixed in its ranks when the
    trial is capped (`args`; see the module's doc). Speed runs keep glibc's own: fixed, every large
    block is mapped afresh, zeroed by the kernel (0.54x the tokens/s at SP=1 and 4,096 here)."""
    return {**os.environ, "DS_TRAIN_BENCH_MMAP_THRESHOLD": str(args.malloc_mmap_threshold if args else 0)}


def _oom_kills(group: Path) -> int:
    for line in (group / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return int((group / "memory.failcnt").read_text()) and 1  # older kernels: the limit was hit


def _remove_cgroup(group: Path) -> None:
    for _ in range(50):  # the ranks' exit is seen by the cgroup shortly after the launcher returns
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def _rates(metrics: Path) -> list[float]:
    if not metrics.is_file():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r["perf/tokens_per_s"] for r in rows if "perf/tokens_per_s" in r]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def versions() -> dict:
    import deepspeed
    import torch
    import transformers

    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "transformers": transformers.__version__}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ds_train_bench_long_context_"))
    try:
        bench = Bench(args, work)
        print(f"bench: longest seq_len under {args.cap_gib:g} GiB per rank ({args.config}, {args.ds_config}, "
              f"{' '.join(args.overrides) or 'no overrides'})", flush=True)
        # DeepSpeed JIT-builds its CPU ops (the shared-memory collectives) where they are not cached, or were
        # last built by another command (the HF Trainer's runs below rebuild them: both ways, 2026-11-26):
        # a build inside a capped rank would be killed by the cap, and read as a length that does not fit.
        bench.trial(2, args.grain * 2, 1, capped=False)
        hf_trainer(args, args.grain * 2, work, steps=2)  # its own op directory: built here, not in a timed run
        longest = {sp: bench.longest(sp) for sp in (1, 2)}
        both = longest[1]
        # Speed without the cap, the sides in turn, --repeats times; each side's best median.
        runs: dict = {side: [] for side in (*SPEED_SIDES, "hf")}
        for _ in range(args.repeats):
            for side, (sp, extra) in SPEED_SIDES.items():
                runs[side].append(bench.trial(sp, both, args.speed_steps, capped=False, extra=extra)["tokens_per_s"]
                                  or 0.0)
            runs["hf"].append(hf_trainer(args, both, work))
        hf = max(runs["hf"], key=lambda r: r.get("tokens_per_s") or 0.0)
        hf["runs_tokens_per_s"] = [r.get("tokens_per_s") for r in runs["hf"]]
        speed = {side: {"tokens_per_s": max(runs[side]), "runs_tokens_per_s": runs[side]} for side in SPEED_SIDES}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = longest[2] / longest[1]
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": _machine(),
           "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "cap_gib_per_rank": args.cap_gib, "cap": "cgroup v1 memory.limit_in_bytes per rank, no swap",
           "malloc_mmap_threshold": args.malloc_mmap_threshold,
           "longest_seq_len": {f"sp{sp}": n for sp, n in longest.items()}, "ratio_sp2_over_sp1": ratio,
           "target": TARGET, "speed_seq_len": both,
           "tokens_per_s_runs": {**{side: t["runs_tokens_per_s"] for side, t in speed.items()},
                                 "hf_trainer_sp2": hf["runs_tokens_per_s"]},
           "tokens_per_s": {**{side: t["tokens_per_s"] for side, t in speed.items()},
                            "hf_trainer_sp2": hf.get("tokens_per_s")},
           "hf_trainer": hf,
           "trials": bench.trials, "versions": versions()}
    rate = out["tokens_per_s"]
    print(f"results: longest seq_len sp1 {longest[1]:,}, sp2 {longest[2]:,}: x{ratio:.2f} (target >= {TARGET}); "
          f"at {both:,}: sp1 {rate['sp1'] or 0:,.0f} tokens/s, sp2 {rate['sp2'] or 0:,.0f} tokens/s "
          f"(x{(rate['sp2'] or 0) / (rate['sp1'] or 1):.2f}); the HF Trainer's own SP 2: "
          + (f"{rate['hf_trainer_sp2']:,.0f} tokens/s (ds_train / HF "
             f"x{(rate['sp2'] or 0) / rate['hf_trainer_sp2']:.2f}; ds_train without its tiles "
             f"{rate['sp2_untiled'] or 0:,.0f} tokens/s, "
             f"x{(rate['sp2_untiled'] or 0) / rate['hf_trainer_sp2']:.2f})"
             if rate["hf_trainer_sp2"] else f"did not run ({hf.get('error')})"))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0 if ratio >= TARGET else 1


def _machine() -> str:
    import platform

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, " \
           f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.0f} GiB"


if __name__ == "__main__":
    sys.exit(cli.run(main))
