"""Asynchronous RL against synchronous RL on the same ranks (issue 61's bench), and the weights' send time of a
1.1B policy over gloo.

    python bench/async_rl.py [--replace] [--no-write] [--reduced] [--iterations N]

The task: RL with a calculator tool (recipes/tool_demo.yaml, after recipes/tool_sft.yaml), its tool slowed to
TOOL_SECONDS a call (this module's `calculator`: ds_train's own after a sleep, so the prompt and its schema are the
same), ENV_WORKERS tool workers on the rollout rank (ript.env_workers), both fixed here before measuring. One node
of 2 ranks: a trainer and a rollout rank (ript.rollout_ranks_per_node=1). Per seed (1234, 1235): synchronous
(ript.max_staleness=0: the rollout rank generates batch i from the weights of update i - 1 while the trainer
waits, then the trainer updates while the rollout rank waits) and asynchronous (max_staleness=1: batch i + 1 is
generated while update i runs), both with 4 PPO epochs an iteration (ript.ppo_epochs=4: an update about as
long as the generation it overlaps) and ript.tis_cap=2 (the weights are 1 wherever the episodes are current).
Fixed before the second measurement, after the first (2026-11-30: 32 episodes an iteration at lr 5e-4 for 20
iterations; the synchronous seeds 15 points apart, one asynchronous seed collapsed): 64 episodes an iteration (8
contexts of 8 rollouts, the recipe's batch), lr 2.5e-4, 30 iterations, so that both arms reach the plateau
where the policy calls the tool on nearly every problem rather than stopping mid-transition.

Measured: the wall time of the iterations (the sum of perf/iteration_s: the same number of updates, without the
start-up), and held-out success of the last checkpoint over every held-out problem (a quarter of the 4,000,
ript heldout_fraction 0.25: at least 800), evaluated greedily in this process with ds_train's calculator (the same
answers, no sleep). Writes runs/bench_async/summary.json and, unless --no-write, BENCHMARKS.md's block
`async-bench` (date, machine, versions, commands, numbers) and docs/post_training.md's `async-doc` (the figures).

--reduced: 2 iterations of a small batch and a 2M-parameter stand-in for the weights' send, writing nothing: a
check that the bench runs end to end (tests/test_doc_commands.py), measuring nothing.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import cli  # noqa: E402
from ds_train.ript.tools import calculator as _calculator  # noqa: E402

TOOL_SECONDS = 0.2  # every tool call's time (the environment step)
ENV_WORKERS = 32  # tool workers on the rollout rank (ript.env_workers)
SEEDS = (1234, 1235)
OUT = ROOT / "runs" / "bench_async"
TASK = ("ript.tasks=[{name: products, data: recipes/data/products.jsonl, tools: ['bench.async_rl:calculator'], "
        "verifier: numeric, max_turns: 3, heldout_fraction: 0.25}]")
EVAL_TASK = [{"name": "products", "data": "recipes/data/products.jsonl", "tools": ["ds_train.ript.tools:calculator"],
              "verifier": "numeric", "max_turns": 3, "heldout_fraction": 0.25}]
COMMON = ("train.global_batch_size=64", "ript.contexts_per_rank=8", "optim.lr=2.5e-4", "ript.ppo_epochs=4",
          "ript.rollout_ranks_per_node=1", "ript.tis_cap=2",
          f"ript.env_workers={ENV_WORKERS}", "ript.sync_every=1",
          "ript.eval_every=0", "ript.eval_contexts=8", "log.plots=false", "checkpoint.every=0")
REDUCED = ("ript.rloo_batch_size=4", "ript.contexts_per_rank=2", "ript.rollout_contexts=2",
           "ript.max_contexts_checked=4", "train.micro_batch_size=8", "train.global_batch_size=8")  # after COMMON
MIN_HELDOUT = 800
# TinyLlama-1.1B's shapes (22 layers, hidden 2048, MLP 5632, 4 key-value heads of 64, vocabulary 32,000), bf16
POLICY_1B = dict(layers=22, hidden=2048, mlp=5632, kv=256, vocab=32000)
STAND_IN = dict(layers=2, hidden=256, mlp=512, kv=64, vocab=1000)


@functools.wraps(_calculator)
def calculator(expression: str) -> str:
    time.sleep(TOOL_SECONDS)
    return _calculator(expression)


def command(seed: int, k: int, out: Path, iterations: int, reduced: bool) -> list[str]:
    return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--module", "ds_train", "ript",
            "--config", "recipes/tool_demo.yaml", "--ds-config", "ds_configs/zero2.json", TASK, *COMMON,
            f"ript.max_staleness={k}", f"ript.iterations={iterations}", f"seed={seed}", f"output_dir={out}",
            *(REDUCED if reduced else ())]


def train(seed: int, k: int, iterations: int, reduced: bool) -> dict:
    out = OUT / f"k{k}_seed{seed}"
    args = command(seed, k, out, iterations, reduced)
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    launched = time.perf_counter() - t0
    (OUT / f"k{k}_seed{seed}.log").write_text(proc.stdout)
    if proc.returncode:
        raise cli.fail(f"`{' '.join(args[1:])}` failed (exit {proc.returncode}); see {OUT}/k{k}_seed{seed}.log")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    per_it = [r["perf/iteration_s"] for r in rows if "perf/iteration_s" in r]
    assert len(per_it) == iterations, f"{out}: {len(per_it)} iterations logged of {iterations}"
    last = rows[-1]

    def mean(key: str, digits: int) -> float:
        return round(statistics.mean(r[key] for r in rows if key in r), digits)

    return {"k": k, "seed": seed, "iterations_s": round(sum(per_it), 2), "launched_s": round(launched, 1),
            "trainer_wait_s": mean("async/trainer_wait_s", 3), "rollout_wait_s": mean("async/rollout_wait_s", 3),
            "weights_send_s": mean("async/weights_send_s", 4),
            "staleness_max": max(r.get("async/staleness_max", 0) for r in rows), "run": str(out.relative_to(ROOT)),
            "success_in_loop": last.get("eval/success")}


def heldout(run_dir: Path, seed: int, reduced: bool) -> dict:
    """Greedy held-out success of the run's last checkpoint over every held-out problem (ds_train's calculator)."""
    from bench.rl_vs_sft import heldout_success
    from ds_train.checkpoint.export import export
    from ds_train.config.file import load_config

    hf = run_dir.parent / f"hf_{run_dir.name}"
    if not hf.exists():
        export(run_dir, hf)
    cfg = load_config(ROOT / "recipes" / "tool_demo.yaml",
                      [f"seed={seed}", f"ript.eval_contexts={16 if reduced else 100000}"])
    cfg = _with_tasks(cfg, EVAL_TASK)
    got = heldout_success(hf, cfg)
    got["contexts"] = _heldout_count(cfg, hf)
    return got


def _with_tasks(cfg, tasks):
    from dataclasses import replace

    return replace(cfg, ript=replace(cfg.ript, tasks=tasks))


def _heldout_count(cfg, hf: Path) -> int:
    from transformers import AutoConfig, AutoTokenizer

    from ds_train.ript.environments import load_tasks

    tasks = load_tasks(cfg, AutoTokenizer.from_pretrained(hf), AutoConfig.from_pretrained(hf))
    return sum(len(t.contexts("heldout", cfg.ript.eval_contexts, cfg.seed)) for t in tasks.values())


def weights_send(shapes: dict) -> dict:
    """Two gloo processes on this host, a split job of a trainer and a rollout rank: the trainer sends a policy of
    `shapes` in bf16 through ds_train's bridge (ds_train/dist/bridge.py), three times; the median."""
    port = str(_free_port())
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "BENCH_SHAPES": json.dumps(shapes), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--send-worker"], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in (0, 1)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise cli.fail(f"the weights' send failed: {outs}")
    return json.loads(outs[0].strip().splitlines()[-1])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _policy_tensors(shapes: dict):
    h, m, kv = shapes["hidden"], shapes["mlp"], shapes["kv"]
    yield "model.embed_tokens.weight", (shapes["vocab"], h)
    for i in range(shapes["layers"]):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj.weight", (h, h)), ("self_attn.k_proj.weight", (kv, h)),
                            ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, h)),
                            ("mlp.gate_proj.weight", (m, h)), ("mlp.up_proj.weight", (m, h)),
                            ("mlp.down_proj.weight", (h, m)), ("input_layernorm.weight", (h,)),
                            ("post_attention_layernorm.weight", (h,))):
            yield p + name, shape
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (shapes["vocab"], h)


def send_worker() -> None:
    import torch

    from ds_train import dist, topology

    shapes = json.loads(os.environ["BENCH_SHAPES"])
    env = topology.split_job(topology.detect_env(), 1)
    dist.init(env, 600, 120)
    bridge = dist.sides()
    names = list(_policy_tensors(shapes))
    numel = sum(math.prod(s) for _, s in names)
    times = []
    if env.split.role == "trainer":
        weights = [(n, torch.randn(s, dtype=torch.bfloat16)) for n, s in names]
        for _ in range(3):
            bridge.broadcast({"go": True})
            bridge.send_weights(iter(weights), version=0)
            times.append(bridge.send_s)
        print(json.dumps({"parameters": numel, "bytes": 2 * numel, "send_s": sorted(times)[1], "tries_s": times}))
    else:
        for _ in range(3):
            bridge.broadcast()
            got = sum(t.numel() for _, t in bridge.receive_weights())
            assert got == numel
    dist.leave()


def table(rows: list[dict], send: dict) -> str:
    by_k = {k: [r for r in rows if r["k"] == k] for k in (0, 1)}
    lines = ["| arm | seed | iterations wall s | held-out success | held-out problems | trainer waited s/it | "
             "rollout rank waited s/it | weights sent s/it | staleness max |", "|---|---|---|---|---|---|---|---|---|"]
    for k, arm in ((0, "synchronous (k=0)"), (1, "asynchronous (k=1)")):
        for r in by_k[k]:
            lines.append(f"| {arm} | {r['seed']} | {r['iterations_s']:.1f} | {r['success_rate']:.3f} | "
                         f"{r['contexts']} | {r['trainer_wait_s']:.3f} | {r['rollout_wait_s']:.3f} | "
                         f"{r['weights_send_s']:.4f} | "
                         f"{r['staleness_max']:g} |")
    wall = {k: statistics.mean(r["iterations_s"] for r in by_k[k]) for k in by_k}
    succ = {k: statistics.mean(r["success_rate"] for r in by_k[k]) for k in by_k}
    se = {k: statistics.stdev(r["success_rate"] for r in by_k[k]) / math.sqrt(len(by_k[k])) for k in by_k}
    gib = send["bytes"] / 2**30
    return "\n".join(lines) + (
        f"\n\nAsynchronous over synchronous, mean of {len(by_k[1])} seeds: wall time of the iterations "
        f"{wall[1]:.1f} s against {wall[0]:.1f} s (**{wall[0] / wall[1]:.2f}x faster**, {wall[1] / wall[0]:.2f} of "
        f"the synchronous time); held-out success {succ[1]:.3f} (standard error {se[1]:.3f}) against {succ[0]:.3f} "
        f"(standard error {se[0]:.3f}), **{100 * (succ[1] - succ[0]):+.1f} points**.\n\nThe weights of a 1.1B "
        f"policy ({send['parameters'] / 1e9:.2f}B parameters, bf16, {gib:.2f} GiB) from the trainer to the rollout "
        f"rank through ds_train's bridge over gloo on this host: **{send['send_s']:.2f} s** (median of 3: "
        f"{', '.join(f'{t:.2f}' for t in send['tries_s'])}), {gib / send['send_s']:.2f} GiB/s.\n")


def main() -> int:
    if "--send-worker" in sys.argv:
        send_worker()
        return 0
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replace", action="store_true", help="remove runs/bench_async first")
    parser.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md as it is")
    parser.add_argument("--reduced", action="store_true", help="2 iterations, small: runs end to end, measures nothing")
    parser.add_argument("--iterations", type=int, default=30, help="updates per run (default 30)")
    args = parser.parse_args()
    if not (ROOT / "runs" / "tool_sft" / "checkpoints").is_dir():
        raise cli.fail("runs/tool_sft is missing: make it first with `deepspeed --num_gpus 2 --module ds_train train "
                       "--config recipes/tool_sft.yaml --ds-config ds_configs/zero2.json`")
    if OUT.exists():
        if not args.replace:
            raise cli.fail(f"{OUT} exists: --replace removes it")
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    iterations = 2 if args.reduced else args.iterations
    rows = []
    for seed in SEEDS[:1] if args.reduced else SEEDS:
        for k in (0, 1):
            row = train(seed, k, iterations, args.reduced)
            row |= heldout(ROOT / row["run"], seed, args.reduced)
            rows.append(row)
            print(json.dumps(row), flush=True)
    send = weights_send(STAND_IN if args.reduced else POLICY_1B)
    summary = {"date": datetime.date.today().isoformat(), "tool_seconds": TOOL_SECONDS, "env_workers": ENV_WORKERS,
               "iterations": iterations, "rows": rows, "weights_send": send,
               "command": " ".join(command(SEEDS[0], 1, OUT / "k1_seed1234", iterations, args.reduced)[1:])}
    (OUT / "summary.json").write_text(json.dumps(summary, indent=2))
    if args.reduced:
        print(f"bench/async_rl.py --reduced: {len(rows)} runs and a weights' send of {send['parameters']:,} "
              f"parameters ran end to end in {OUT}; nothing measured, nothing written")
        return 0
    text = table(rows, send)
    print(text)
    if not args.no_write:
        write(summary, text)
    return 0


def write(summary: dict, text: str) -> None:
    from bench.rl_vs_sft import machine, rewrite, versions

    block = (f"{summary['date']}, {machine()}; {versions()}. `python bench/async_rl.py --replace`: per seed, "
             f"`deepspeed --num_gpus 2 --module ds_train ript --config recipes/tool_demo.yaml --ds-config "
             f"ds_configs/zero2.json` with the tool slowed to {summary['tool_seconds'] * 1000:.0f} ms a call, "
             f"{summary['env_workers']} tool workers on the rollout rank, a trainer and a rollout rank, "
             f"{' '.join(o for o in COMMON if not o.startswith(('ript.eval', 'log.', 'checkpoint.')))}, "
             f"{summary['iterations']} iterations, ript.max_staleness 0 and 1.\n\n" + text)
    rewrite(ROOT / "BENCHMARKS.md", "async-bench", block)
    rewrite(ROOT / "docs" / "post_training.md", "async-doc", text.split("\n\n", 1)[1])  # the figures, not the table


if __name__ == "__main__":
    sys.exit(cli.run(main))
