"""Per-step overhead of ds_train's training loop against a bare DeepSpeed engine loop.

    deepspeed --num_gpus 2 bench/overhead.py [--config recipes/quickstart.yaml] \
        [--ds-config ds_configs/zero2.json] [--steps 20] [--repeats 5] [--warmup 5] \
        [--out FILE.json] [key=value overrides]

One engine, one resolved config, built once by `ds_train.run.build_run` (output_dir in a
temporary directory; no progress bar, no checkpoints, no evaluation: train.max_steps is set so high
that neither side ever reaches it). Then `--repeats` times, in alternating order:

  bare      N optimizer steps of: for each micro-batch, next-token cross entropy,
            engine.backward(loss), engine.step(); nothing else
  ds_train  train_loop(run, data, start, start + N) exactly as `train` calls it: every component
            asked at every step (the non-finite guard, the meter and evaluator, the logger, the
            checkpointer with its per-step SIGTERM/SIGINT agreement, an all-reduce); metrics
            reduced and logged every log.every steps

Both sides read the same data stream (`rank_micro_batches`) from one running step counter, so the
data position always advances. Each timed block is fenced by a barrier on both ends. Rank 0 prints
the tokens/s of every repeat and the median ratio ds_train / bare (>= 0.97 is the target).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere, with or without `pip install -e`
    sys.path.insert(0, str(ROOT))

from bench import cli  # noqa: E402

TARGET = 0.97
# Keeps both sides clear of the final-step eval / save, and of the end of the LR schedule.
NEVER = 10**6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "recipes" / "quickstart.yaml"),
                   help="run config YAML (default recipes/quickstart.yaml)")
    p.add_argument("--ds-config", default=str(ROOT / "ds_configs" / "zero2.json"),
                   help="DeepSpeed JSON template (default ds_configs/zero2.json)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per timed block (default 20)")
    p.add_argument("--repeats", type=int, default=5, help="timed blocks per side (default 5)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per side first (default 5)")
    p.add_argument("--out", help="also write the results as JSON here (rank 0)")
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # from the deepspeed launcher
    p.add_argument("overrides", nargs="*", metavar="key=value", help="run config overrides")
    args = p.parse_args(argv)
    if args.steps <= 0 or args.repeats <= 0 or args.warmup < 0:
        p.error("--steps and --repeats must be positive, --warmup >= 0")
    return args


def quiet() -> None:
    """The same noise settings as `ds-train` without --debug."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def shared_tmp_dir() -> Path:
    """One scratch run directory for all ranks of this launch (they share MASTER_PORT and parent)."""
    tag = f"{os.environ.get('MASTER_PORT', '0')}_{os.getppid()}"
    return Path(tempfile.gettempdir()) / f"ds_train_bench_overhead_{tag}"


def bare_steps(engine, data, plan, rank: int, world: int, first: int, count: int) -> None:
    """The baseline: data positions first .. first+count-1, forward / backward / step, nothing else."""
    import torch
    import torch.nn.functional as F

    from ds_train.data.datasets import rank_micro_batches

    for pos in range(first, first + count):
        for batch in rank_micro_batches(data, pos, plan.global_batch_size, plan.micro_batch_size,
                                        rank, world):
            tokens = torch.from_numpy(batch).to(engine.device)
            logits = engine(input_ids=tokens[:, :-1], use_cache=False).logits  # as forward_loss
            targets = tokens[:, 1:]
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                                   reduction="sum") / targets.numel()
            engine.backward(loss)
            engine.step()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet()
    import torch

    from ds_train import dist, topology
    from ds_train.config.file import load_config
    from ds_train.inputs import check_inputs
    from ds_train.start import build_run
    from ds_train.train.loop import train_spec

    env = topology.detect_env()
    run_dir = shared_tmp_dir()
    overrides = [*args.overrides, f"output_dir={run_dir}", "log.progress=false", "checkpoint.every=0",
                 "checkpoint.save_final=false", "train.eval_every=0", f"train.max_steps={NEVER}"]
    cfg = load_config(args.config, overrides)
    needed = args.warmup * 2 + args.steps * args.repeats * 2
    if needed >= cfg.train.max_steps:
        raise cli.fail(f"{needed} steps would reach train.max_steps={cfg.train.max_steps}")
    inputs = check_inputs(cfg, args.ds_config)
    data = inputs.data
    with build_run(inputs, env, train_spec(cfg)) as run:
        run.say(f"bench: {args.repeats} repeats x {args.steps} steps per side (+{args.warmup} warm-up each); "
                f"log.every {cfg.log.every}; torch threads per rank {torch.get_num_threads()}; "
                f"accelerator {dist.accelerator_name()}")
        rc = measure(args, cfg, run, data, run.say)
    if env.local_rank == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
    return rc


def measure(args, cfg, run, data, say) -> int:
    import torch

    from ds_train import dist
    from ds_train.train.loop import train_loop

    engine, plan, env = run.engine, run.plan, run.env
    rank, world = run.data_rank, run.dims.data  # the slice of each global batch this rank reads

    def ds_train_steps(first: int, count: int) -> None:
        train_loop(run, data, first, first + count)  # a signal: save, then Preempted

    step = 0  # optimizer steps taken so far = the next data position
    if args.warmup:
        bare_steps(engine, data.train, plan, rank, world, step, args.warmup)
        step += args.warmup
        ds_train_steps(step, args.warmup)
        step += args.warmup

    def timed(fn) -> float:
        gc.collect()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    tokens = plan.tokens_per_step * args.steps
    rows = []
    for r in range(args.repeats):
        order = ("bare", "ds_train") if r % 2 == 0 else ("ds_train", "bare")
        secs = {}
        for side in order:
            first = step
            if side == "bare":
                secs[side] = timed(lambda: bare_steps(engine, data.train, plan, rank, world,
                                                      first, args.steps))
            else:
                secs[side] = timed(lambda: ds_train_steps(first, args.steps))
            step += args.steps
        row = {"repeat": r + 1, "order": list(order),
               "bare_s": secs["bare"], "ds_train_s": secs["ds_train"],
               "bare_tokens_per_s": tokens / secs["bare"], "ds_train_tokens_per_s": tokens / secs["ds_train"]}
        row["ratio"] = row["ds_train_tokens_per_s"] / row["bare_tokens_per_s"]
        rows.append(row)
        say(f"repeat {r + 1}/{args.repeats} ({order[0]} first): bare {row['bare_tokens_per_s']:,.0f} "
            f"tok/s ({row['bare_s']:.2f} s) | ds_train {row['ds_train_tokens_per_s']:,.0f} tok/s "
            f"({row['ds_train_s']:.2f} s) | ratio {row['ratio']:.3f}")

    ratio = statistics.median(r["ratio"] for r in rows)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": args.config, "ds_config": args.ds_config, "overrides": args.overrides,
        "world_size": env.world_size, "accelerator": dist.accelerator_name(),
        "torch_threads_per_rank": torch.get_num_threads(),
        "steps_per_block": args.steps, "repeats": args.repeats, "warmup_steps": args.warmup,
        "log_every": cfg.log.every, "tokens_per_step": plan.tokens_per_step,
        "median_bare_tokens_per_s": statistics.median(r["bare_tokens_per_s"] for r in rows),
        "median_ds_train_tokens_per_s": statistics.median(r["ds_train_tokens_per_s"] for r in rows),
        "median_ratio": ratio, "target": TARGET, "met": ratio >= TARGET, "repeats_detail": rows,
    }
    say(f"median tokens/s: bare {result['median_bare_tokens_per_s']:,.0f} | "
        f"ds_train {result['median_ds_train_tokens_per_s']:,.0f}")
    say("per-repeat ratios: " + ", ".join(f"{r['ratio']:.3f}" for r in rows))
    say(f"overhead ratio (ds_train / bare tokens/s): {ratio:.3f} (target >= {TARGET})")
    if args.out and env.is_main:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
