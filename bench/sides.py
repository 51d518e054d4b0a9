"""Two configurations side by side on 2 processes: what bench/tensor_parallel.py and bench/lora.py
share, so that each keeps only what its comparison is (its sides and their configs, its prediction
of the model states per rank and any further measurement, its ratios).

Each side is a real `deepspeed --num_gpus 2` launch of the script's own worker, which builds the run
through ds_train and times train_step; the sides take turns --repeats times and each keeps its best
median, so that a noisy machine hurts both alike.
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

from bench import cli  # the scripts that import this module put the repository on sys.path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


def parse_args(doc: str, argv: list[str] | None, add=None) -> argparse.Namespace:
    """The options of both scripts; `add(parser)` adds a script's own, listed before --data."""
    p = cli.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per launch (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2: one of them measures the "
                   "model states)")
    p.add_argument("--repeats", type=int, default=2, help="launches per side, in turn (default 2)")
    p.add_argument("--hidden", type=int, default=512, help="hidden size (default 512; 8 heads)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step (default 8)")
    if add:
        add(p)
    p.add_argument("--data", default=str(ROOT / "data" / "cache" / "python_stdlib"),
                   help="data.dir (default: the quickstart's corpus, prepared on first use)")
    p.add_argument("--out", help="write the results here as JSON")
    p.add_argument("--worker", nargs=2, metavar=("SIDE", "RESULT"), help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return p.parse_args(argv)


def run_config(args: argparse.Namespace, out_dir: Path) -> dict:
    """The run both sides start from (the same model, data and global batch); a side adds its own part."""
    h = args.hidden
    return {"output_dir": str(out_dir), "seed": 1,
            "model": {"dtype": "fp32", "config": {
                "model_type": "llama", "hidden_size": h, "intermediate_size": h * 11 // 4,
                "num_hidden_layers": args.layers, "num_attention_heads": 8, "num_key_value_heads": 8,
                "max_position_embeddings": args.seq_len, "tie_word_embeddings": False}},
            "data": {"dir": args.data, "sources": ["python-stdlib"], "vocab_size": 4096},
            "train": {"max_steps": args.warmup + args.steps, "micro_batch_size": 2,
                      "global_batch_size": args.global_batch, "seq_len": args.seq_len},
            "checkpoint": {"save_final": False, "resume": "none"},
            "log": {"progress": False, "sample_prompt": "", "wandb": "off"}}


def worker(args: argparse.Namespace, side: str, result: str, config, ds_config: str, figures) -> int:
    """One side in this launch's process group: build the run, time the steps, measure the states.

    `config(args, side, out_dir)`: the side's run config; `ds_config`: a file in ds_configs/;
    `figures(cfg, inputs, run, held)`, on every rank (it may gather): the script's entries of the
    side's record (its prediction beside `held`, each rank's model-state bytes).
    """
    from ds_train import dist, topology
    from ds_train.config.file import build_config
    from ds_train.data.datasets import rank_micro_batches
    from ds_train.inputs import check_inputs
    from ds_train.train.losses import forward_loss
    from ds_train.plan.memory import engine_state_bytes
    from ds_train.start import build_run
    from ds_train.train.loop import train_spec, train_step

    cfg = build_config(config(args, side, Path(result).parent / f"run_{side}"), source=side)
    inputs = check_inputs(cfg, str(ROOT / "ds_configs" / ds_config))
    env = topology.detect_env()
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
        own = figures(cfg, inputs, run, dist.all_gather_object(measured))
        if env.rank == 0:
            step_s = statistics.median(times[max(args.warmup - 2, 0):])
            Path(result).write_text(json.dumps({
                "side": side, "zero_stage": run.zero_stage, **own, "step_s": step_s, "step_times_s": times,
                "tokens_per_s": plan.global_batch_size * plan.seq_len / step_s}))
    return 0


def compare(args: argparse.Namespace, script: str, names, prefix: str, forward: tuple[str, ...] = (),
            note=lambda r: "") -> dict[str, list[dict]]:
    """Every side's launches, the sides in turn --repeats times, each printed as it ends (`note(r)`:
    what a script adds to the line); `forward`: the script's own options for its worker."""
    runs: dict[str, list[dict]] = {side: [] for side in names}
    with tempfile.TemporaryDirectory(prefix=prefix) as work:
        for _ in range(args.repeats):
            for side in names:
                runs[side].append(launch(args, script, side, Path(work), forward))
                r = runs[side][-1]
                print(f"{side}: {r['tokens_per_s']:,.0f} tokens/s, model states "
                      f"{max(r['model_states_gib_per_rank']) * 1024:,.1f} MiB per rank "
                      f"(plan {r['predicted_gib_per_rank'] * 1024:,.1f}){note(r)}", flush=True)
    return runs


def launch(args: argparse.Namespace, script: str, side: str, work: Path, forward: tuple[str, ...]) -> dict:
    result = work / f"{side}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
           str(free_port()), str(Path(script).resolve()), "--worker", side, str(result),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--hidden", str(args.hidden),
           "--layers", str(args.layers), "--seq-len", str(args.seq_len), "--global-batch",
           str(args.global_batch), *forward, "--data", args.data]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not result.is_file():
        log = cli.saved_output(proc.stdout + proc.stderr, side)
        raise cli.fail(f"the {side} launch failed (exit {proc.returncode}); its output: {log}")
    return json.loads(result.read_text())


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def results(args: argparse.Namespace, argv: list[str] | None, runs: dict[str, list[dict]], baseline: str,
            **extra) -> dict:
    """The results both scripts write, up to their ratios: each side's best run under "sides"; the
    model's parameters are the `baseline` side's (LoRA's adapters are not the model's); `extra`
    follows "model"."""
    best = {side: max(rs, key=lambda r: r["tokens_per_s"]) for side, rs in runs.items()}
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": _machine(),
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "model": {"hidden": args.hidden, "layers": args.layers, "params": best[baseline]["params"]}, **extra,
            "seq_len": args.seq_len, "global_batch": args.global_batch, "sides": best,
            "tokens_per_s_runs": {side: [r["tokens_per_s"] for r in rs] for side, rs in runs.items()}}


def ratios(top: dict, bottom: dict, name: str, per_rank: tuple[str, ...]) -> dict:
    """`top` over `bottom` (two sides' records), keyed FIGURE_NAME (tokens_per_s_lora_over_full):
    tokens/s, and of each per-rank figure the fullest rank's, the one a device must hold."""
    out = {f"tokens_per_s_{name}": top["tokens_per_s"] / bottom["tokens_per_s"]}
    for figure in per_rank:
        out[f"{figure}_{name}"] = max(top[f"{figure}_gib_per_rank"]) / max(bottom[f"{figure}_gib_per_rank"])
    return out


def finish(args: argparse.Namespace, out: dict, line: str) -> int:
    """Print the results line and write the results (--out)."""
    print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


def _machine() -> str:
    import platform

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, " \
           f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.0f} GiB"
