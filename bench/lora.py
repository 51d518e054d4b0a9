"""LoRA (model.lora: rank 16 on every linear layer) beside full fine-tuning, ZeRO-2 on 2 processes:
the same model, data and global batch; per rank, the model-state bytes the engine holds
(parameters, gradients, optimizer states: ds_train.memory.engine_state_bytes at a step boundary)
beside the memory plan's prediction, the peak resident memory of the rank, and tokens/s (the median
step after warm-up).

    python bench/lora.py [--steps 8] [--warmup 2] [--repeats 2] [--hidden 512] [--layers 4] \
        [--seq-len 256] [--rank 16] [--data DIR] [--out FILE.json]

Each side is a real `deepspeed --num_gpus 2` launch of this script's worker, which builds the run
through ds_train (build_run: the rendered ds_config, peft's adapters, the engine) and times
train_step; the sides take turns --repeats times and each keeps its best median, so that a noisy
machine hurts both alike. The model states are bookkeeping and hold on any device; the step time
on a CPU (fp32, the frozen base's weight gradients skipped, the adapters' small matmuls added)
does not predict a GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDES = {"full": 0, "lora": 16}  # model.lora.rank
GiB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per launch (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2: one of them measures the "
                   "model states)")
    p.add_argument("--repeats", type=int, default=2, help="launches per side, in turn (default 2)")
    p.add_argument("--hidden", type=int, default=512, help="hidden size (default 512; 8 heads)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of the lora side (default 16)")
    p.add_argument("--data", default=str(ROOT / "data" / "cache" / "python_stdlib"),
                   help="data.dir (default: the quickstart's corpus, prepared on first use)")
    p.add_argument("--out", help="write the results here as JSON")
    p.add_argument("--worker", nargs=2, metavar=("SIDE", "RESULT"), help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return p.parse_args(argv)


def run_config(args: argparse.Namespace, side: str, out_dir: Path) -> dict:
    h = args.hidden
    rank = args.rank if SIDES[side] else 0
    return {"output_dir": str(out_dir), "seed": 1,
            "model": {"dtype": "fp32", "lora": {"rank": rank, "alpha": 2 * max(rank, 1)}, "config": {
                "model_type": "llama", "hidden_size": h, "intermediate_size": h * 11 // 4,
                "num_hidden_layers": args.layers, "num_attention_heads": 8, "num_key_value_heads": 8,
                "max_position_embeddings": args.seq_len, "tie_word_embeddings": False}},
            "data": {"dir": args.data, "sources": ["python-stdlib"], "vocab_size": 4096},
            "train": {"max_steps": args.warmup + args.steps, "micro_batch_size": 2,
                      "global_batch_size": args.global_batch, "seq_len": args.seq_len},
            "checkpoint": {"save_final": False, "resume": "none"},
            "log": {"progress": False, "sample_prompt": "", "wandb": "off"}}


def worker(args: argparse.Namespace, side: str, result: str) -> int:
    """One side in this launch's process group: build the run, time the steps, measure the states."""
    import resource

    from ds_train import dist
    from ds_train.configfile import build_config
    from ds_train.data.datasets import rank_micro_batches
    from ds_train.inputs import check_inputs
    from ds_train.losses import forward_loss
    from ds_train.memory import engine_state_bytes, model_shape, model_states
    from ds_train.run import build_run
    from ds_train.trainer import train_spec, train_step

    cfg = build_config(run_config(args, side, Path(result).parent / f"run_{side}"), source=side)
    inputs = check_inputs(cfg, str(ROOT / "ds_configs" / "zero2.json"))
    env = dist.detect_env()
    with build_run(inputs, env, train_spec(cfg), quiet=True) as run:
        engine, dims, plan = run.engine, run.dims, run.plan
        rank = dims.data_rank(env.rank)
        def batches(step):
            return rank_micro_batches(inputs.data.train, step, plan.global_batch_size, plan.micro_batch_size,
                                      rank, dims.data)

        train_step(engine, batches(0))  # the optimizer states exist from here
        for batch in batches(1):  # a step by hand, measured where tests/test_memory.py measures
            loss, tokens = forward_loss(engine, batch)
            engine.backward(loss / tokens)
            if engine.is_gradient_accumulation_boundary():
                measured = engine_state_bytes(engine)  # parameters, gradients, optimizer states
            engine.step()
        times = []
        for step in range(2, args.warmup + args.steps):
            t0 = time.perf_counter()
            train_step(engine, batches(step), group=run.token_group, data_parallel=dims.gradient_ranks(run.zero_stage))
            times.append(time.perf_counter() - t0)
        shape = model_shape(inputs.source.hf_config, cfg.model.lora)
        predicted = model_states(shape.n_params, run.zero_stage, run.dtype, dims.data,
                                 trainable=shape.trainable or None).held
        held = dist.all_gather_object(measured)
        peak_rss = dist.all_gather_object(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        if env.rank == 0:
            step_s = statistics.median(times[max(args.warmup - 2, 0):])
            Path(result).write_text(json.dumps({
                "side": side, "zero_stage": run.zero_stage, "params": shape.n_params,
                "trainable": shape.trainable or shape.n_params, "model_states_gib_per_rank": [b / GiB for b in held],
                "peak_rss_gib_per_rank": [b / GiB for b in peak_rss],
                "predicted_gib_per_rank": predicted / GiB, "step_s": step_s, "step_times_s": times,
                "tokens_per_s": plan.global_batch_size * plan.seq_len / step_s}))
    return 0


def launch(args: argparse.Namespace, side: str, work: Path) -> dict:
    result = work / f"{side}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
           str(free_port()), str(Path(__file__).resolve()), "--worker", side, str(result),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--hidden", str(args.hidden),
           "--layers", str(args.layers), "--seq-len", str(args.seq_len), "--global-batch",
           str(args.global_batch), "--rank", str(args.rank), "--data", args.data]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not result.is_file():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise SystemExit(f"bench: the {side} launch failed (exit {proc.returncode}):\n" + "\n".join(tail))
    return json.loads(result.read_text())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args, *args.worker)
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="ds_train_bench_lora_") as work:
        for _ in range(args.repeats):
            for side in SIDES:
                runs[side].append(launch(args, side, Path(work)))
                r = runs[side][-1]
                print(f"{side}: {r['tokens_per_s']:,.0f} tokens/s, model states "
                      f"{max(r['model_states_gib_per_rank']) * 1024:,.1f} MiB per rank "
                      f"(plan {r['predicted_gib_per_rank'] * 1024:,.1f}), peak RSS "
                      f"{max(r['peak_rss_gib_per_rank']) * 1024:,.0f} MiB", flush=True)
    best = {side: max(rs, key=lambda r: r["tokens_per_s"]) for side, rs in runs.items()}
    lora, full = best["lora"], best["full"]
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": _machine(),
           "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "model": {"hidden": args.hidden, "layers": args.layers, "params": full["params"]}, "rank": args.rank,
           "seq_len": args.seq_len, "global_batch": args.global_batch, "sides": best,
           "tokens_per_s_runs": {side: [r["tokens_per_s"] for r in rs] for side, rs in runs.items()},
           "ratios": {"tokens_per_s_lora_over_full": lora["tokens_per_s"] / full["tokens_per_s"],
                      "model_states_lora_over_full": max(lora["model_states_gib_per_rank"]) /
                      max(full["model_states_gib_per_rank"]),
                      "peak_rss_lora_over_full": max(lora["peak_rss_gib_per_rank"]) /
                      max(full["peak_rss_gib_per_rank"])}}
    r = out["ratios"]
    print(f"results: LoRA r={args.rank} / full fine-tuning, ZeRO-2 on 2 processes: tokens/s "
          f"x{r['tokens_per_s_lora_over_full']:.2f}, model states per rank x{r['model_states_lora_over_full']:.2f}, "
          f"peak RSS per rank x{r['peak_rss_lora_over_full']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


def _machine() -> str:
    import platform

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, " \
           f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.0f} GiB"


if __name__ == "__main__":
    sys.exit(main())
