"""Asynchronous RL against synchronous RL on the same 2 ranks, split and colocated (issue 61's bench, issue 72's
arms), and the weights' send time of a 1.1B policy over gloo.

    python bench/async_rl.py [--replace] [--no-write] [--reduced] [--iterations N]

The task: RL with a calculator tool (recipes/tool_demo.yaml, after recipes/tool_sft.yaml), its tool slowed to
TOOL_SECONDS a call (this module's `calculator`: ds_train's own after a sleep, so the prompt and its schema are the
same), both fixed here before measuring. One node of 2 ranks, three arms per seed (1234, 1235, 1236):

- colocated (ds_train's default, ript.rollout_ranks_per_node=0): both ranks generate an iteration's episodes,
  then both train on them (ript.max_staleness=0, ript.tis_cap=0: the policy samples its own episodes);
- synchronous split (ript.rollout_ranks_per_node=1, max_staleness=0): a trainer and a rollout rank; the rollout
  rank generates batch i from the weights of update i - 1 while the trainer waits, then the trainer updates
  while the rollout rank waits;
- asynchronous split (max_staleness=1): batch i + 1 is generated while update i runs.

Every arm trains on the same batch: the ranks that generate share one quota of SIDE["groups"] accepted contexts of
K rollouts an iteration (train.global_batch_size episodes, one update of ript.ppo_epochs=4 passes: an update about
as long as the generation it overlaps), and one cap of contexts checked, contexts a generate round and tool
workers (ript.env_workers), split evenly over them (`arm_options`: ript.contexts_per_rank is per trainer, so a
split job's one trainer takes the whole quota and each of the 2 colocated ranks half of it). The split arms set
ript.tis_cap=2 (the weights are 1 wherever the episodes are current). Dynamic sampling may check more contexts in
one arm than another: the table gives each run's contexts checked and accepted (the sums of ript/checked and
ript/accepted over its iterations).

Fixed before the second measurement, after the first (2026-11-30: 32 episodes an iteration at lr 5e-4 for 20
iterations; the synchronous seeds 15 points apart, one asynchronous seed collapsed): 64 episodes an iteration (8
contexts of 8 rollouts, the recipe's batch), lr 2.5e-4, 30 iterations, so that both arms reach the plateau
where the policy calls the tool on nearly every problem rather than stopping mid-transition. The colocated arm and
the third seed came after the second measurement (issue 72), with those settings unchanged.

Measured: the wall time of the iterations (the sum of perf/iteration_s: the same number of updates, without the
start-up), and held-out success of the last checkpoint over every held-out problem (a quarter of the 4,000,
ript heldout_fraction 0.25: at least 800), evaluated greedily in this process with ds_train's calculator (the same
answers, no sleep); means over the seeds with their standard errors. Writes runs/bench_async/summary.json and,
unless --no-write, BENCHMARKS.md's block `async-bench` (date, machine, versions, commands, numbers) and
docs/post_training.md's `async-doc` (the figures).

--reduced: 2 iterations of a small batch in every arm, one seed, and a 2M-parameter stand-in for the weights'
send, writing nothing: a check that the bench runs end to end, its table included (tests/test_doc_commands.py),
measuring nothing.
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
SEEDS = (1234, 1235, 1236)
OUT = ROOT / "runs" / "bench_async"
TASK = ("ript.tasks=[{name: products, data: recipes/data/products.jsonl, tools: ['bench.async_rl:calculator'], "
        "verifier: numeric, max_turns: 3, heldout_fraction: 0.25}]")
EVAL_TASK = [{"name": "products", "data": "recipes/data/products.jsonl", "tools": ["ds_train.ript.tools:calculator"],
              "verifier": "numeric", "max_turns": 3, "heldout_fraction": 0.25}]
COMMON = ("optim.lr=2.5e-4", "ript.ppo_epochs=4", "ript.sync_every=1",
          "ript.eval_every=0", "ript.eval_contexts=8", "log.plots=false", "checkpoint.every=0")
# What the ranks that generate share an iteration, whichever they are (arm_options splits it over them): the
# accepted contexts of K rollouts the update trains on (groups x K = the global batch), the contexts they may check,
# the contexts of one generate round, the tool workers; the micro-batch of a trainer at most.
SIDE = dict(groups=8, checked=32, round=8, env_workers=32, k=8, global_batch=64, micro=32)
REDUCED_SIDE = dict(groups=2, checked=4, round=2, env_workers=32, k=4, global_batch=8, micro=8)
RANKS = 2  # one node's
ARMS = {  # name: ript.rollout_ranks_per_node, ript.max_staleness, ript.tis_cap
    "colocated": (0, 0, 0),
    "synchronous": (1, 0, 2),
    "asynchronous": (1, 1, 2),
}
MIN_HELDOUT = 800
# TinyLlama-1.1B's shapes (22 layers, hidden 2048, MLP 5632, 4 key-value heads of 64, vocabulary 32,000), bf16
POLICY_1B = dict(layers=22, hidden=2048, mlp=5632, kv=256, vocab=32000)
STAND_IN = dict(layers=2, hidden=256, mlp=512, kv=64, vocab=1000)


@functools.wraps(_calculator)
def calculator(expression: str) -> str:
    time.sleep(TOOL_SECONDS)
    return _calculator(expression)


def arm_options(arm: str, reduced: bool) -> tuple[str, ...]:
    """The overrides of `arm`: SIDE's numbers per rank. ript.contexts_per_rank is per trainer (a split job's
    rollout ranks share the trainers' quota), ript.max_contexts_checked, rollout_contexts and env_workers per rank
    that generates (a split job's rollout ranks; colocated, every rank)."""
    rollout_ranks, k, tis = ARMS[arm]
    trainers, generating = RANKS - rollout_ranks, rollout_ranks or RANKS
    side = REDUCED_SIDE if reduced else SIDE
    if side["groups"] % trainers or any(side[key] % generating for key in ("checked", "round", "env_workers")):
        raise cli.fail(f"{arm}: {side} does not split evenly over {trainers} trainer(s) and {generating} rank(s) "
                       f"that generate")
    return (f"ript.rollout_ranks_per_node={rollout_ranks}", f"ript.max_staleness={k}", f"ript.tis_cap={tis}",
            f"ript.rloo_batch_size={side['k']}", f"ript.contexts_per_rank={side['groups'] // trainers}",
            f"ript.max_contexts_checked={side['checked'] // generating}",
            f"ript.rollout_contexts={side['round'] // generating}",
            f"ript.env_workers={side['env_workers'] // generating}", f"train.global_batch_size={side['global_batch']}",
            f"train.micro_batch_size={min(side['micro'], side['global_batch'] // trainers)}")


def episodes_per_update(options: tuple[str, ...]) -> int:
    """The episodes one update of a run with `options` trains on, as ds_train reads them: contexts_per_rank x K per
    trainer (2 ranks: a split job's one trainer, or both ranks colocated)."""
    o = dict(x.split("=", 1) for x in options)
    trainers = RANKS - int(o["ript.rollout_ranks_per_node"])
    return int(o["ript.contexts_per_rank"]) * int(o["ript.rloo_batch_size"]) * trainers


def command(seed: int, arm: str, out: Path, iterations: int, reduced: bool) -> list[str]:
    options = arm_options(arm, reduced)
    side = REDUCED_SIDE if reduced else SIDE
    # every arm trains on the same episodes an update: the global batch
    if not episodes_per_update(options) == side["groups"] * side["k"] == side["global_batch"]:
        raise cli.fail(f"{arm}: {' '.join(options)} trains on {episodes_per_update(options)} episodes an update, "
                       f"not the {side['groups']} x {side['k']} = global batch {side['global_batch']} of every arm")
    return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--module", "ds_train", "ript",
            "--config", "recipes/tool_demo.yaml", "--ds-config", "ds_configs/zero2.json", TASK, *COMMON, *options,
            f"ript.iterations={iterations}", f"seed={seed}", f"output_dir={out}"]


def train(seed: int, arm: str, iterations: int, reduced: bool) -> dict:
    name = f"{arm}_seed{seed}"
    out = OUT / name
    args = command(seed, arm, out, iterations, reduced)
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    launched = time.perf_counter() - t0
    (OUT / f"{name}.log").write_text(proc.stdout)
    if proc.returncode:
        raise cli.fail(f"`{' '.join(args[1:])}` failed (exit {proc.returncode}); see {OUT}/{name}.log")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    per_it = [r for r in rows if "perf/iteration_s" in r]
    if len(per_it) != iterations or any(k not in r for r in per_it for k in ("ript/checked", "ript/accepted")):
        raise cli.fail(f"{out}/metrics.jsonl: {len(per_it)} iterations logged of {iterations}, or one without "
                       f"ript/checked and ript/accepted")
    last = rows[-1]

    def mean(key: str, digits: int) -> float | None:  # a split job's async/* (a colocated run has none)
        got = [r[key] for r in rows if key in r]
        return round(statistics.mean(got), digits) if got else None

    return {"arm": arm, "seed": seed, "iterations_s": round(sum(r["perf/iteration_s"] for r in per_it), 2),
            "launched_s": round(launched, 1), "checked": int(sum(r["ript/checked"] for r in per_it)),
            "accepted": int(sum(r["ript/accepted"] for r in per_it)),
            "trainer_wait_s": mean("async/trainer_wait_s", 3), "rollout_wait_s": mean("async/rollout_wait_s", 3),
            "weights_send_s": mean("async/weights_send_s", 4),
            "staleness_max": max((r["async/staleness_max"] for r in rows if "async/staleness_max" in r),
                                 default=0 if ARMS[arm][0] else None),  # logged where a batch held episodes
            "run": str(out.relative_to(ROOT)), "success_in_loop": last.get("eval/success")}


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
    if not reduced and got["contexts"] < MIN_HELDOUT:
        raise cli.fail(f"{run_dir}: {got['contexts']} held-out problems evaluated, fewer than {MIN_HELDOUT}")
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


ARM_NAMES = {"colocated": "colocated (both generate, then both train)", "synchronous": "synchronous split (k=0)",
             "asynchronous": "asynchronous split (k=1)"}


def mean_se(values: list[float]) -> tuple[float, float | None]:
    """The mean and its standard error over seeds (None of one seed: --reduced)."""
    return statistics.mean(values), (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None)


def _se(se: float | None, digits: int) -> str:
    return f"{se:.{digits}f}" if se is not None else "n/a"


def _or_dash(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict], send: dict) -> str:
    by_arm = {arm: [r for r in rows if r["arm"] == arm] for arm in ARMS}
    lines = ["| arm | seed | iterations wall s | held-out success | held-out problems | contexts checked | "
             "contexts accepted | trainer waited s/it | rollout rank waited s/it | weights sent s/it | staleness max |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, arm_rows in by_arm.items():
        for r in arm_rows:
            lines.append(f"| {ARM_NAMES[arm]} | {r['seed']} | {r['iterations_s']:.1f} | {r['success_rate']:.3f} | "
                         f"{r['contexts']} | {r['checked']} | {r['accepted']} | "
                         f"{_or_dash(r['trainer_wait_s'], '.3f')} | {_or_dash(r['rollout_wait_s'], '.3f')} | "
                         f"{_or_dash(r['weights_send_s'], '.4f')} | "
                         f"{_or_dash(r['staleness_max'], 'g')} |")
    wall = {arm: mean_se([r["iterations_s"] for r in by_arm[arm]]) for arm in ARMS}
    succ = {arm: mean_se([r["success_rate"] for r in by_arm[arm]]) for arm in ARMS}
    checked = {arm: statistics.mean(r["checked"] for r in by_arm[arm]) for arm in ARMS}
    a = "asynchronous"
    seeds = sorted({r["seed"] for r in by_arm[a]})

    def against(arm: str, what: str) -> str:
        # per seed (the same seed's runs of both arms), the ratio of the wall times and the difference of success
        pair = {s: [r for r in by_arm[arm] + by_arm[a] if r["seed"] == s] for s in seeds}
        ratio = mean_se([x["iterations_s"] / y["iterations_s"] for x, y in pair.values()])
        diff = mean_se([100 * (y["success_rate"] - x["success_rate"]) for x, y in pair.values()])
        return (f"{what} {wall[arm][0]:.1f} s (standard error {_se(wall[arm][1], 1)}): **{ratio[0]:.2f}x faster** "
                f"(the mean of the per-seed ratios, standard error {_se(ratio[1], 2)}); held-out success "
                f"{succ[arm][0]:.3f} (standard error {_se(succ[arm][1], 3)}), **{diff[0]:+.1f} points** (the mean of "
                f"the per-seed differences, standard error {_se(diff[1], 1)}); "
                f"{checked[arm]:.0f} contexts checked a run")

    gib = send["bytes"] / 2**30
    return "\n".join(lines) + (
        f"\n\nAsynchronous split against both synchronous arms on the same 2 ranks, mean of {len(seeds)} "
        f"seed{'s' * (len(seeds) > 1)}: wall "
        f"time of the iterations {wall[a][0]:.1f} s (standard error {_se(wall[a][1], 1)}), held-out success "
        f"{succ[a][0]:.3f} (standard error {_se(succ[a][1], 3)}), {checked[a]:.0f} contexts checked a run; against "
        f"{against('synchronous', 'synchronous split')}; against {against('colocated', 'colocated')}."
        f"\n\nThe weights of {'a 1.1B policy' if send['parameters'] > 1e9 else 'a stand-in policy'} "
        f"({send['parameters'] / 1e9:.2f}B parameters, bf16, {gib:.2f} GiB) from the trainer to the rollout "
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
        for arm in ARMS:
            row = train(seed, arm, iterations, args.reduced)
            row |= heldout(ROOT / row["run"], seed, args.reduced)
            rows.append(row)
            print(json.dumps(row), flush=True)
    send = weights_send(STAND_IN if args.reduced else POLICY_1B)
    side = REDUCED_SIDE if args.reduced else SIDE
    summary = {"date": datetime.date.today().isoformat(), "tool_seconds": TOOL_SECONDS, "side": side,
               "iterations": iterations, "rows": rows, "weights_send": send,
               "commands": {arm: " ".join(command(SEEDS[0], arm, OUT / f"{arm}_seed{SEEDS[0]}", iterations,
                                                  args.reduced)[1:]) for arm in ARMS}}
    (OUT / "summary.json").write_text(json.dumps(summary, indent=2))
    text = table(rows, send)
    print(text)
    if args.reduced:
        print(f"bench/async_rl.py --reduced: {len(rows)} runs ({', '.join(ARMS)}) and a weights' send of "
              f"{send['parameters']:,} parameters ran end to end in {OUT}; nothing measured, nothing written")
        return 0
    if not args.no_write:
        write(summary, text)
    return 0


def write(summary: dict, text: str) -> None:
    from bench.rl_vs_sft import machine, rewrite, versions

    side = summary["side"]
    common = " ".join(o for o in COMMON if not o.startswith(("ript.eval", "log.", "checkpoint.")))
    arms = "; ".join(f"{arm}: {' '.join(o for o in arm_options(arm, False) if not o.startswith('ript.rloo'))}"
                     for arm in ARMS)
    block = (f"{summary['date']}, {machine()}; {versions()}. `python bench/async_rl.py --replace`: per seed "
             f"({', '.join(map(str, SEEDS))}) and arm, `deepspeed --num_gpus 2 --module ds_train ript --config "
             f"recipes/tool_demo.yaml --ds-config ds_configs/zero2.json` with the tool slowed to "
             f"{summary['tool_seconds'] * 1000:.0f} ms a call, {common}, "
             f"{summary['iterations']} iterations of {side['groups']} accepted contexts x K={side['k']} (the global "
             f"batch, {side['global_batch']} episodes) an update, at most {side['checked']} contexts checked, "
             f"{side['round']} a generate round and {side['env_workers']} tool workers in all over the ranks that "
             f"generate; {arms}.\n\n" + text)
    rewrite(ROOT / "BENCHMARKS.md", "async-bench", block)
    rewrite(ROOT / "docs" / "post_training.md", "async-doc", text.split("\n\n", 1)[1])  # the figures, not the table


if __name__ == "__main__":
    sys.exit(cli.run(main))
