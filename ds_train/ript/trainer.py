"""The RIPT loop: `deepspeed --num_gpus 2 --module ds_train ript --config C --ds-config D`.

Per iteration, every rank samples its own tasks' contexts until it has its quota of accepted ones
(0 < successes < K), the accepted contexts of all ranks reach early_stop_fraction of the total quota,
or it has checked its cap; then all ranks update the policy through the DeepSpeed engine on the
same number of (padded) micro-batches. Every count that is logged is summed over ranks. The run
itself (engine, sinks, checkpoints, signals, teardown) is built by ds_train/start.py, as for training.
With rollout ranks (ript.rollout_ranks_per_node) the trainers take each iteration's groups from them instead
(ds_train/ript/feed.py) and the rollout ranks run ds_train/ript/rollout_ranks.py.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ds_train import dist, topology
from ds_train.checkpoint.rundir import RIPT
from ds_train.config import RunConfig
from ds_train.fs import write_atomic
from ds_train.observe.metrics import Interval
from ds_train.observe.startup import StartupClock
from ds_train.ript.algorithms import describe_algorithm
from ds_train.ript.batches import routes
from ds_train.ript.completions import Completions
from ds_train.ript.counts import SyncedCounts
from ds_train.ript.feed import RolloutFeed
from ds_train.ript.inputs import RiptInputs, ript_spec
from ds_train.ript.rollout import max_rollout_tokens, model_policy, scripted_policy
from ds_train.ript.rollout_ranks import serve_rollouts
from ds_train.ript.sampler import ContextSampler, Tally, by_family, family, merge_states
from ds_train.ript.sampling import Generating, run_episodes, sample
from ds_train.ript.sharding import format_shards
from ds_train.ript.update import token_logp, update
from ds_train.ript.vllm_engine import VllmRollouts
from ds_train.run import Run
from ds_train.start import build_run
from ds_train.train.benchmarks import Benchmarks
from ds_train.train.reference import ReferenceSpec, build_reference, report_reference


@dataclass
class RiptJob:
    """What RIPT adds to a run: this rank's tasks and their sampler."""

    run: Run
    tasks: dict
    shards: list[list[str]]
    sampler: ContextSampler
    scripted: Any
    pending: dict = field(default_factory=dict)  # this rank's counts not yet synced, from a checkpoint
    reference: Any = None  # the KL term's reference policy (ds_train/train/reference.py), or None
    completions: Any = None  # rank 0's rollouts for completions.jsonl (ript.log_completions)
    vllm: Any = None  # this rank's vLLM engine (ript.rollout_engine=vllm), or None: the policy generates
    feed: Any = None  # with rollout ranks: their batches and the weights to them (ds_train/ript/feed.py), else None
    sampled: dict = field(default_factory=dict)  # the tasks as the ranks that sample shard them (with rollout ranks:
    #                                              theirs; else `tasks`): what the counts are kept by

    def pause_engine(self) -> None:
        if self.vllm is not None:
            self.vllm.pause()

    def sync_engine(self, iteration: int) -> None:
        """The policy was updated at `iteration`: vLLM takes its weights (every rank together)."""
        if self.vllm is not None:
            self.vllm.updated(iteration)

    @property
    def mine(self) -> list[str]:
        return self.shards[self.run.data_rank]

    def rank_state(self) -> dict:
        """What this rank's file of a checkpoint adds (trainer 0: what the rollout ranks hold)."""
        return self.feed.rank_state() if self.feed is not None else {}

    def generating(self) -> Generating:
        run = self.run
        return Generating(run.cfg.ript, run.tokenizer, self.tasks, run.collective_forward or self.vllm is not None,
                          run.beat, sum(1 for s in self.shards if s), run.cfg.seed, run.data_rank,
                          run.cfg.ript.contexts_per_rank)

    def policy(self, temperature: float):
        run = self.run
        if self.scripted is not None:
            return scripted_policy(self.scripted, run.tokenizer)
        if self.vllm is not None:
            return self.vllm.policy(temperature)
        return model_policy(run.engine.module, run.tokenizer, run.cfg.ript.max_new_tokens, temperature,
                            run.collective_forward, list(self.tasks.values()))

    @property
    def max_tokens(self) -> int:
        """The most tokens a rollout of any task can generate."""
        return max(max_rollout_tokens(t, self.run.cfg.ript.max_new_tokens) for t in self.tasks.values())


@dataclass
class RiptState:
    """The loop's own state: carried in every checkpoint (with each task's sampler position)."""

    iteration: int = 0
    evals: list = field(default_factory=list)
    totals: dict = field(default_factory=dict)
    synced: dict = field(default_factory=dict)  # the statistics of the last sync (ript/*, policy/*)
    benchmarks: list = field(default_factory=list)  # lm_eval's scorings (the benchmarks section), by iteration


def ript(cfg: RunConfig, ds_config_path: str) -> dict:
    import torch

    clock = StartupClock.begin()
    env, spec = topology.split_job(topology.detect_env(), cfg.ript.rollout_ranks_per_node), ript_spec(cfg)
    if env.split and env.split.role == "rollout":
        return serve_rollouts(cfg, ds_config_path, env)
    inputs = RiptInputs.check(cfg, ds_config_path, env, spec)
    clock.mark("inputs")
    with build_run(inputs.run, env, spec, clock=clock) as run:
        # each data-parallel rank samples its own rollouts; the ranks of a tensor group the same ones
        torch.manual_seed(cfg.seed * 1000 + run.data_rank)
        r = cfg.ript
        sampler = ContextSampler([inputs.tasks[n] for n in inputs.shards[run.data_rank]], r.train_contexts,
                                 cfg.seed, r.skip_solved, r.retest_after, r.task_weighting)
        job = RiptJob(run, inputs.tasks, inputs.shards, sampler, inputs.scripted,
                      reference=build_reference(run, ReferenceSpec.of(cfg), run.weights) if r.kl_coef else None,
                      completions=Completions(run.paths.completions, r.log_completions, run.env.is_main),
                      sampled=inputs.rollout_tasks)
        if env.split:
            job.feed = RolloutFeed(run, dist.sides(), inputs.rollout_tasks, inputs.rollout_shards,
                                   routes(env.split, run.dims))
            run.say(f"rollout ranks: the last {r.rollout_ranks_per_node} of every node's "
                    f"{env.split.job.local_world_size} ({env.split.world('rollout').world_size} in all) generate, "
                    f"{env.world_size} train; ript.max_staleness {r.max_staleness}")
        run.say(format_shards(inputs.rollout_shards, RiptInputs.costs(cfg, inputs.rollout_tasks)))
        run.say(f"K={r.rloo_batch_size}; quota {inputs.quota} contexts per {'rollout ' if env.split else ''}rank; "
                f"policy "
                f"{r.policy or cfg.model.path}; {describe_algorithm(cfg)}; rollouts: {inputs.engine}")
        report_reference(run, job.reference)
        with feeding(job):
            saved = resume(job)
            job.completions.rewind(saved.iteration if saved else -1)
            with rollout_engine(job, saved.iteration if saved else 0):  # its weights: the checkpoint's on a resume
                state = saved or start(job)
                scored = cfg.benchmarks.tasks and cfg.benchmarks.at_start
                run.mark_startup("rollout engine" if saved else
                                 f"rollout engine, evaluation 0{', benchmarks' if scored else ''}")
                first = state.iteration
                ript_loop(run, job, state)
        run.write_plots()
        report(job, state, first)
        return asdict(state)


@contextlib.contextmanager
def feeding(job: RiptJob):
    """With rollout ranks: they leave when the trainers do, at the end or at a stop (a failure mid-meeting leaves
    them to the launcher, which ends the job's ranks when one fails)."""
    try:
        yield
    except BaseException:
        if job.feed is not None and not job.feed.in_meeting:
            job.feed.close()
        raise
    if job.feed is not None:
        job.feed.close()


@contextlib.contextmanager
def rollout_engine(job: RiptJob, version: int):
    """This rank's vLLM engine for the block (ript.rollout_engine=vllm), built from the policy's weights
    as they are now; nothing with the Hugging Face engine or a scripted policy."""
    if job.run.cfg.ript.rollout_engine != "vllm" or job.scripted is not None:
        yield
        return
    import torch

    run = job.run
    job.vllm = VllmRollouts(run.engine.module, run.tokenizer, run.cfg.ript, run.dtype, run.cfg.seed, run.data_rank,
                            version, run.env, say=run.rank_log.info)

    def policy_logp(ids: list[int]) -> list[float]:
        run.engine.eval()
        with torch.no_grad():
            out = token_logp(run.engine, torch.tensor([ids], device=run.engine.device))[0].tolist()
        run.engine.train()
        return out

    try:
        worst = job.vllm.probe(policy_logp)
        run.say(f"vLLM's log-probs against the policy's forward at start-up: largest difference {worst:.3g}")
        yield
    finally:
        job.vllm.close()
        job.vllm = None


def resume(job: RiptJob) -> RiptState | None:
    saved = job.run.maybe_resume()
    if job.feed is not None:
        job.feed.start(saved.get("rank", {}).get("async"), saved["ript"]["sampler"]) if saved else \
            job.feed.start(None, None)
    if saved is None:
        return None
    job.sampler.load_state(saved["ript"]["sampler"])
    job.pending = saved.get("rank", {}).get("counts", {})
    return RiptState(**{k: saved["ript"][k] for k in ("iteration", "evals", "totals", "synced", "benchmarks")
                       if k in saved["ript"]})


def start(job: RiptJob) -> RiptState:
    """A fresh run: the held-out evaluation of the starting policy (iteration 0)."""
    state = RiptState(totals=Tally(list(job.sampled)).as_dict())
    benchmarks = Benchmarks(job.run, job.run.cfg.ript.iterations, state.benchmarks)
    job.run.logger.log(HeldOut(job, Interval(0, job.run.spec.last)).record(0, state) | benchmarks.maybe_score(
        0, lambda: write_results(job, state)), 0)
    return state


def ript_loop(run: Run, job: RiptJob, state: RiptState) -> None:
    """Iterations: sample (dynamic), update, then the sync, the evaluation, the log and the save
    each act if the iteration is theirs."""
    r = run.cfg.ript
    act = job.policy(r.temperature)
    counts = SyncedCounts(job, Interval(r.sync_every, r.iterations))
    counts.load_state(job.pending)
    held_out = HeldOut(job, Interval(r.eval_every, r.iterations))
    benchmarks = Benchmarks(run, r.iterations, state.benchmarks)
    if scores := benchmarks.resume(state.iteration, lambda: write_results(job, state)):  # where nothing kept it
        run.logger.log(scores, state.iteration)
    with run.progress(state.iteration) as progress:
        for it in range(state.iteration + 1, r.iterations + 1):
            with counts.rollouts():
                groups = (job.feed.batch(it, counts.window, job.completions) if job.feed is not None else
                          sample_here(job, act, counts.window, it))
            job.pause_engine()
            counts.policy += update(run, r, groups, it, job.reference, job.max_tokens, seed=run.cfg.seed,
                                    poison=it in run.cfg.train.debug_nonfinite_steps)
            job.sync_engine(it)
            run.maybe_finish_startup("first iteration")
            state.iteration = it
            metrics = counts.maybe_sync(it, state) | held_out.maybe_evaluate(it, state)
            if job.feed is not None and metrics:
                metrics |= job.feed.metrics()
            run.logger.log(metrics, it)  # before the save: an iteration its checkpoint holds has its metrics logged
            progress.advance(metrics)
            run.checkpointer.maybe_save(it, lambda: checkpoint_state(job, state),
                                        lambda: {"counts": counts.state()} | job.rank_state())
            if scores := benchmarks.maybe_score(it, lambda: write_results(job, state)):  # after the save: a
                run.logger.log(scores, it)  # scoring never costs the checkpoint


def sample_here(job: RiptJob, act, tally: Tally, it: int) -> list[list]:
    """This rank's own groups of iteration `it` (no rollout ranks): generated in eval mode."""
    job.run.engine.eval()
    groups = sample(job.generating(), job.sampler, bool(job.mine), act, tally, it, job.completions)
    job.run.engine.train()
    return groups


def checkpoint_state(job: RiptJob, state: RiptState) -> dict:
    """The loop state plus all ranks' sampler states, merged by task (a collective)."""
    if job.feed is not None:  # the rollout ranks' samplers, and what they hold for trainer 0's rank file
        return {"iteration": state.iteration, "ript": {**asdict(state), "sampler": job.feed.save_state(),
                                                       **job.feed.state()}}
    samplers = dist.all_gather_object(job.sampler.state())
    return {"iteration": state.iteration, "ript": {**asdict(state), "sampler": merge_states(samplers, job.shards)}}


class HeldOut:
    """Greedy success on each task's held-out contexts, counts summed over ranks (exact); every
    evaluation goes into ript_results.json."""

    def __init__(self, job: RiptJob, interval: Interval):
        self.job, self.interval = job, interval

    def maybe_evaluate(self, it: int, state: RiptState) -> dict:
        return self.record(it, state) if it in self.interval else {}

    def record(self, it: int, state: RiptState) -> dict:
        self.job.run.beat(it, "eval")
        result = evaluate(self.job, it)
        state.evals.append({"iteration": it, **result})
        write_results(self.job, state)
        return {"eval/success": result["success_rate"]} | {
            f"eval/{n}/success": t["success_rate"] for n, t in result["per_task"].items()}


def evaluate(job: RiptJob, it: int) -> dict:
    """Greedy success on each task's held-out contexts (at iteration `it`); counts summed over ranks (exact)."""
    run, r = job.run, job.run.cfg.ript
    jobs = [(job.tasks[n], c, 0) for n in job.mine
            for c in job.tasks[n].contexts("heldout", r.eval_contexts, run.cfg.seed)]
    run.engine.eval()
    episodes = run_episodes(job.generating(), job.policy(temperature=0.0), jobs)
    run.engine.train()
    job.completions.add(it, "eval", episodes)
    names = sorted({family(n) for n in job.tasks})  # a dataset task's parts add up under its name
    local = {n: [0.0, 0.0] for n in names}
    for e in episodes:
        local[family(e.task.name)][0] += e.success
        local[family(e.task.name)][1] += 1
    flat = dist.all_reduce_sum([v for n in names for v in local[n]])
    per_task = {n: {"successes": int(flat[2 * i]), "episodes": int(flat[2 * i + 1]),
                    "success_rate": flat[2 * i] / flat[2 * i + 1] if flat[2 * i + 1] else 0.0}
                for i, n in enumerate(names)}
    wins, total = sum(t["successes"] for t in per_task.values()), sum(t["episodes"] for t in per_task.values())
    return {"success_rate": wins / total if total else 0.0, "successes": wins, "episodes": total,
            "per_task": per_task}


def write_results(job: RiptJob, state: RiptState) -> None:
    run = job.run
    if run.env.is_main:
        write_atomic(run.paths.results(RIPT), json.dumps({
            "iteration": state.iteration, "world_size": run.env.world_size,
            "shards": {f"rank{r}": names for r, names in enumerate(job.shards)},
            "eval": state.evals[-1] if state.evals else None, "evals": state.evals,
            "train_counts": by_family(state.totals),
            "statistics": Tally.from_counts(state.totals).metrics() if state.totals else {},  # the whole run's
            "last_sync": state.synced, **({"benchmarks": state.benchmarks} if state.benchmarks else {})}, indent=2))


def report(job: RiptJob, state: RiptState, first: int) -> None:
    """The closing line: what the run did (`first`: the iteration this process started from) and the
    held-out success from its first evaluation to its last."""
    last = job.run.cfg.ript.iterations
    outcome = [f"done, {state.iteration} iterations" if state.iteration > first else
               f"nothing to do, already at iteration {first} >= ript.iterations={last} (raise ript.iterations to "
               f"continue, or set another output_dir)"]
    if state.evals:
        start, final = state.evals[0], state.evals[-1]
        outcome.append(f"held-out success {start['success_rate']:.3f} (iteration {start['iteration']}) -> "
                       f"{final['success_rate']:.3f} (iteration {final['iteration']})")
    job.run.say_outcome(", ".join(outcome))
