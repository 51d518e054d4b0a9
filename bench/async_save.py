"""The training stall of a periodic save: written in the background (checkpoint.async_save) against
a save that blocks, on the same run.

    deepspeed --num_gpus 2 bench/async_save.py [--config recipes/quickstart.yaml] \
        [--ds-config ds_configs/zero2.json] [--steps 9] [--every 3] [--repeats 3] \
        [--out FILE.json] [key=value overrides]

One engine, built once by `ds_train.run.build_run` (a larger model than the quickstart's by default,
so that a save is worth hiding: see DEFAULT_MODEL). Then `--repeats` times, the three sides in
rotating order, each a block of `--steps` steps of `train_loop` exactly as `train` runs it:

  none        no save
  blocking    a save after every `--every`-th step of the block (not its last), as checkpoint.every does
  background  the same saves with checkpoint.async_save: the block ends once the last one is whole

Two measures of the stall, per save: `blocked_s`, the time the loop spent inside the checkpointer's
save and wait calls; `extra_s`, the block's time minus the `none` block's of the same repeat,
divided by the saves (what the run really lost, the writer's competition for the CPU included).
Rank 0 prints the medians and the ratios background / blocking (target <= 0.5 for both).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import shutil
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import cli  # noqa: E402
from bench.overhead import NEVER, quiet, shared_tmp_dir  # noqa: E402

TARGET = 0.5
# About 30M parameters: a ZeRO-2 tag of ~0.45 GB (fp32 weights, AdamW moments), a step of about a second here.
DEFAULT_MODEL = ["model.config.hidden_size=512", "model.config.intermediate_size=1408", "model.config.num_hidden_layers=8",
                 "model.config.num_attention_heads=8", "model.config.num_key_value_heads=8", "model.dtype=fp32",
                 "train.global_batch_size=8", "train.micro_batch_size=2"]
SIDES = ("none", "blocking", "background")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "recipes" / "quickstart.yaml"))
    p.add_argument("--ds-config", default=str(ROOT / "ds_configs" / "zero2.json"))
    p.add_argument("--steps", type=int, default=9, help="steps per timed block (default 9)")
    p.add_argument("--every", type=int, default=3, help="a save after every N-th step of a block (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="blocks per side (default 3)")
    p.add_argument("--out", help="also write the results as JSON here (rank 0)")
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="run config overrides (after the model's)")
    args = p.parse_args(argv)
    if args.every <= 0 or args.steps <= args.every or args.repeats <= 0:
        p.error("--every must be positive and below --steps, --repeats positive")
    return args


class Timed:
    """The checkpointer of one block: saves at the chosen steps; the time spent in its calls counted."""

    def __init__(self, base, background: bool, saves: set[int], seq: int):
        self.ck = copy.copy(base)
        self.ck.cfg = dataclasses.replace(base.cfg, async_save=background, keep=2)
        self.ck.seq, self.ck.due = seq, lambda step: step in saves
        self.blocked_s = 0.0
        for name in ("save", "wait"):
            setattr(self.ck, name, self._timed(getattr(self.ck, name)))

    def _timed(self, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.blocked_s += time.perf_counter() - t0
        return call


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet()
    from ds_train import dist, topology
    from ds_train.config.file import load_config
    from ds_train.inputs import check_inputs
    from ds_train.start import build_run
    from ds_train.train.loop import train_loop, train_spec

    env = topology.detect_env()
    run_dir = shared_tmp_dir()
    overrides = [*DEFAULT_MODEL, *args.overrides, f"output_dir={run_dir}", "log.progress=false",
                 "checkpoint.every=0", "checkpoint.save_final=false", "checkpoint.async_save=true",
                 "train.eval_every=0", f"train.max_steps={NEVER}", "log.every=1000"]
    cfg = load_config(args.config, overrides)
    inputs = check_inputs(cfg, args.ds_config)
    rows = []
    with build_run(inputs, env, train_spec(cfg)) as run:
        base, say = run.checkpointer, run.say
        say(f"bench: {args.repeats} repeats x {args.steps} steps per side, a save every {args.every}; "
            f"{run.n_params / 1e6:.1f}M parameters, ZeRO {run.zero_stage}, world {env.world_size}")
        step, seq = 0, base.seq
        train_loop(run, inputs.data, step, step + 2)  # warm-up
        step += 2
        for r in range(args.repeats):
            order = SIDES[r % 3:] + SIDES[:r % 3]
            row = {"repeat": r + 1, "order": list(order)}
            for side in order:
                saves = set() if side == "none" else {step + k for k in range(args.every, args.steps, args.every)}
                timed = Timed(base, side == "background", saves, seq)
                run.checkpointer = timed.ck
                gc.collect()
                dist.barrier()
                t0 = time.perf_counter()
                train_loop(run, inputs.data, step, step + args.steps)
                timed.ck.wait(step + args.steps)  # the block ends with its saves whole
                dist.barrier()
                row[f"{side}_s"] = time.perf_counter() - t0
                row[f"{side}_blocked_s"] = timed.blocked_s / max(len(saves), 1)
                row["saves"] = max(len(saves), row.get("saves", 0))
                step, seq = step + args.steps, timed.ck.seq
            for side in SIDES[1:]:
                row[f"{side}_extra_s"] = (row[f"{side}_s"] - row["none_s"]) / row["saves"]
            rows.append(row)
            say(f"repeat {r + 1} ({', '.join(order)}): block none {row['none_s']:.1f} s, blocking "
                f"{row['blocking_s']:.1f} s, background {row['background_s']:.1f} s; per save: blocked "
                f"{row['blocking_blocked_s']:.2f} / {row['background_blocked_s']:.2f} s, extra "
                f"{row['blocking_extra_s']:.2f} / {row['background_extra_s']:.2f} s (blocking / background)")
        run.checkpointer = base
        result = summarize(args, env, run, rows)
        for line in result["said"]:
            say(line)
        if args.out and env.is_main:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if env.local_rank == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def summarize(args, env, run, rows: list[dict]) -> dict:
    med = {key: statistics.median(r[key] for r in rows)
           for key in ("blocking_blocked_s", "background_blocked_s", "blocking_extra_s", "background_extra_s")}
    blocked = med["background_blocked_s"] / med["blocking_blocked_s"]
    extra = med["background_extra_s"] / med["blocking_extra_s"] if med["blocking_extra_s"] > 0 else float("nan")
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "config": args.config,
            "ds_config": args.ds_config, "overrides": [*DEFAULT_MODEL, *args.overrides],
            "world_size": env.world_size, "params_m": run.n_params / 1e6, "steps": args.steps, "every": args.every,
            "medians": med, "blocked_ratio": blocked, "extra_ratio": extra, "target": TARGET,
            "met": blocked <= TARGET and extra <= TARGET, "repeats_detail": rows,
            "said": [f"median stall per save, blocking: {med['blocking_blocked_s']:.2f} s in the loop, "
                     f"{med['blocking_extra_s']:.2f} s of block time",
                     f"median stall per save, background: {med['background_blocked_s']:.2f} s in the loop, "
                     f"{med['background_extra_s']:.2f} s of block time",
                     f"ratio background / blocking: {blocked:.2f} in the loop, {extra:.2f} of block time "
                     f"(target <= {TARGET})"]}


if __name__ == "__main__":
    sys.exit(cli.run(main))
