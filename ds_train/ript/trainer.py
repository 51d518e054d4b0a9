"""The RIPT loop: `deepspeed --num_gpus 2 --module ds_train ript --config C --ds-config D`.

Per iteration, every rank samples its own tasks' contexts until it has its quota of accepted ones
(0 < successes < K), the accepted contexts of all ranks reach early_stop_fraction of the total quota,
or it has checked its cap; then all ranks update the policy through the DeepSpeed engine on the
same number of (padded) micro-batches. Every count that is logged is summed over ranks. The run
itself (engine, sinks, checkpoints, signals, teardown) is built by ds_train/start.py, as for training.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from ds_train import dist, topology
from ds_train.checkpoint.rundir import RIPT
from ds_train.config import RunConfig
from ds_train.errors import UserError
from ds_train.fs import write_atomic
from ds_train.inputs import RunInputs, check_inputs, rank_config_check
from ds_train.observe.metrics import Interval
from ds_train.observe.startup import StartupClock
from ds_train.plan.batch import rollout_update_steps
from ds_train.plan.parallel import plan_dims
from ds_train.ript.algorithms import describe_algorithm, keep_mask
from ds_train.ript.completions import Completions
from ds_train.ript.counts import SyncedCounts
from ds_train.ript.datatask import check_task_entries, split_for_ranks
from ds_train.ript.environments import load_tasks
from ds_train.ript.rollout import Episode, max_rollout_tokens, model_policy, rollout, scripted_policy
from ds_train.ript.sampler import ContextSampler, Tally, by_family, family, merge_states
from ds_train.ript.sharding import format_shards, shard_tasks
from ds_train.ript.tasks import load_object
from ds_train.ript.update import token_logp, update
from ds_train.ript.vllm_engine import VllmRollouts, check_rollout_engine
from ds_train.run import Run, RunSpec
from ds_train.start import build_run
from ds_train.train.probe import probe
from ds_train.train.reference import ReferenceSpec, build_reference, report_reference


def ript_spec(cfg: RunConfig) -> RunSpec:
    r = cfg.ript
    return RunSpec(RIPT, last=r.iterations, same_world=True,
                   steps=lambda plan: r.iterations * r.ppo_epochs *
                   rollout_update_steps(r.contexts_per_rank, r.rloo_batch_size, plan),
                   check_model=check_ript_config, probe=functools.partial(probe, losses=False))


def check_ript_config(cfg: RunConfig, hf_config=None, world_size: int = 1, local_world_size: int = 1,
                      device: str | None = None) -> None:
    """ript's own checks of its config (RunSpec.check_model: each rank's check_config, and the launch
    preflight's): `hf_config` None: those that need no model, before it is read."""
    r = cfg.ript
    if not cfg.model.path:
        raise UserError("model.path: RIPT starts from a trained policy: a Hugging Face directory or a "
                        "ds_train run directory (recipes/ript_sft.yaml makes one)")
    if cfg.parallel.sequence > 1:
        raise UserError(f"parallel.sequence={cfg.parallel.sequence}: RIPT's rollouts generate token by token, "
                        f"which Ulysses sequence parallelism cannot split; set parallel.sequence=1 for ript")
    if cfg.parallel.tensor > 1 and r.kl_coef > 0:
        raise UserError(f"ript.kl_coef={r.kl_coef:g} with parallel.tensor={cfg.parallel.tensor}: ds_train builds "
                        f"the reference policy without AutoTP's split; use ZeRO-3 (parallel.tensor=1) to "
                        f"partition both models, or ript.kl_coef=0")
    check_task_entries(cfg)
    if hf_config is None:
        return
    check_rollout_engine(cfg, hf_config, world_size, local_world_size, device)
    if getattr(hf_config, "output_router_logits", False) is True:
        raise UserError("model.config.output_router_logits=true: RIPT's policy loss does not add the router's "
                        "auxiliary loss yet; set it to false for ript")


@dataclass(frozen=True)
class RiptInputs:
    """Tasks, their sharding over the data-parallel ranks, the policy and the run's inputs (the
    model and its tokenizer, the DeepSpeed JSON), checked before anything is written."""

    tasks: dict  # name -> task, every task (each data-parallel rank owns some)
    shards: list[list[str]]
    scripted: Any  # ript.policy, when a script acts instead of the model
    run: RunInputs
    engine: str  # what generates the rollouts: "the policy's generate", or the vLLM package and version

    @classmethod
    def check(cls, cfg: RunConfig, ds_config_path: str, env, spec: RunSpec) -> "RiptInputs":
        r = cfg.ript
        check_ript_config(cfg)  # fail fast: before the model is read
        run = check_inputs(cfg, ds_config_path, rank_config_check(cfg, spec, env, ds_config_path), data=False)
        engine = check_rollout_engine(cfg, run.source.hf_config, env.world_size, env.local_world_size)
        tasks = load_tasks(cfg, run.source.tokenizer, run.source.hf_config)
        data_parallel = plan_dims(cfg.parallel, env.world_size).data
        tasks = {part.name: part for task in tasks.values() for part in split_for_ranks(task, data_parallel)}
        shards = shard_tasks(cls.costs(cfg, tasks), data_parallel, r.sharding, r.allow_idle_ranks)
        scripted = load_scripted(r.policy) if r.policy else None
        return cls(tasks, shards, scripted, run, engine)

    @staticmethod
    def costs(cfg: RunConfig, tasks: dict) -> dict[str, float]:
        """A task's estimated cost: its training contexts x turns (a dataset: the prompts it has, up to
        ript.train_contexts)."""
        return {n: len(t.contexts("train", cfg.ript.train_contexts, cfg.seed)) * t.max_turns
                if hasattr(t, "prompt_ids") else cfg.ript.train_contexts * t.max_turns for n, t in tasks.items()}


def load_scripted(spec: str):
    """ript.policy `module:Class` -> an instance with act(task, context, transcript, index) -> str."""
    policy = load_object(spec, "ript.policy")
    if not callable(getattr(policy, "act", None)):
        raise UserError(f"ript.policy: {spec!r} has no act(task, context, transcript, index) method")
    return policy


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


def ript(cfg: RunConfig, ds_config_path: str) -> dict:
    import torch

    clock = StartupClock.begin()
    env, spec = topology.detect_env(), ript_spec(cfg)
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
                      completions=Completions(run.paths.completions, r.log_completions, run.env.is_main))
        run.say(format_shards(inputs.shards, RiptInputs.costs(cfg, inputs.tasks)))
        run.say(f"K={r.rloo_batch_size}; quota {r.contexts_per_rank} contexts per rank; policy "
                f"{r.policy or cfg.model.path}; {describe_algorithm(cfg)}; rollouts: {inputs.engine}")
        report_reference(run, job.reference)
        saved = resume(job)
        job.completions.rewind(saved.iteration if saved else -1)
        with rollout_engine(job, saved.iteration if saved else 0):  # its weights: the checkpoint's on a resume
            state = saved or start(job)
            run.mark_startup("rollout engine" if saved else "rollout engine, evaluation 0")
            first = state.iteration
            ript_loop(run, job, state)
        run.write_plots()
        report(job, state, first)
        return asdict(state)


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
    if saved is None:
        return None
    job.sampler.load_state(saved["ript"]["sampler"])
    job.pending = saved.get("rank", {}).get("counts", {})
    return RiptState(**{k: saved["ript"][k] for k in ("iteration", "evals", "totals", "synced") if k in saved["ript"]})


def start(job: RiptJob) -> RiptState:
    """A fresh run: the held-out evaluation of the starting policy (iteration 0)."""
    state = RiptState(totals=Tally(list(job.tasks)).as_dict())
    job.run.logger.log(HeldOut(job, Interval(0, job.run.spec.last)).record(0, state), 0)
    return state


def ript_loop(run: Run, job: RiptJob, state: RiptState) -> None:
    """Iterations: sample (dynamic), update, then the sync, the evaluation, the log and the save
    each act if the iteration is theirs."""
    r = run.cfg.ript
    act = job.policy(r.temperature)
    counts = SyncedCounts(job, Interval(r.sync_every, r.iterations))
    counts.load_state(job.pending)
    held_out = HeldOut(job, Interval(r.eval_every, r.iterations))
    with run.progress(state.iteration) as progress:
        for it in range(state.iteration + 1, r.iterations + 1):
            with counts.rollouts():
                groups = sample(job, act, counts.window, it)
            job.pause_engine()
            counts.policy += update(run, r, groups, it, job.reference, job.max_tokens, seed=run.cfg.seed,
                                    poison=it in run.cfg.train.debug_nonfinite_steps)
            job.sync_engine(it)
            run.maybe_finish_startup("first iteration")
            state.iteration = it
            metrics = counts.maybe_sync(it, state) | held_out.maybe_evaluate(it, state)
            run.logger.log(metrics, it)
            progress.advance(metrics)
            run.checkpointer.maybe_save(it, lambda: checkpoint_state(job, state), lambda: {"counts": counts.state()})


def checkpoint_state(job: RiptJob, state: RiptState) -> dict:
    """The loop state plus all ranks' sampler states, merged by task (a collective)."""
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


def run_episodes(job: RiptJob, act, jobs: list) -> list[Episode]:
    """Rollouts of this rank's jobs. Under ZeRO-3 and expert parallelism generation is a collective, and vLLM's
    engines step in lockstep (ds_train/ript/vllm_engine.py): every rank makes the same number of policy calls
    (batches x turns), with dummy rows where it has nothing to do."""
    r = job.run.cfg.ript
    size = r.rollout_contexts * r.rloo_batch_size
    if not (job.run.collective_forward or job.vllm is not None) or r.policy:  # generation of this rank's own
        return rollout(act, job.run.tokenizer, jobs, size, max_new_tokens=r.max_new_tokens)
    batches = int(dist.all_reduce_max([float(math.ceil(len(jobs) / size))])[0])
    turns = max(t.max_turns for t in job.tasks.values())
    episodes = []
    for b in range(batches):
        episodes += rollout(act, job.run.tokenizer, jobs[b * size:(b + 1) * size], size, turns=turns,
                            max_new_tokens=r.max_new_tokens)
    return episodes


def sample(job: RiptJob, act, tally: Tally, it: int) -> list[list[Episode]]:
    """Dynamic rollout sampling: this rank's accepted groups (each K episodes of one context)."""
    import torch

    r = job.run.cfg.ript
    k, quota = r.rloo_batch_size, r.contexts_per_rank
    target = math.ceil(r.early_stop_fraction * quota * sum(1 for s in job.shards if s))
    groups: list[list[Episode]] = []
    checked = rounds = 0
    job.run.engine.eval()
    while True:
        job.run.beat(it, "rollout")  # a round: every rank all-reduces its progress
        done = not job.mine or len(groups) >= quota or checked >= r.max_contexts_checked
        accepted, busy = dist.all_reduce_sum([float(min(len(groups), quota)), float(not done)])
        if busy == 0 or accepted >= target or rounds == r.max_sampling_rounds > 0:
            break
        rounds += 1
        picked = [] if done else job.sampler.next(min(r.rollout_contexts, r.max_contexts_checked - checked), tally)
        checked += len(picked)
        episodes = run_episodes(job, act, [(task, ctx, i) for task, _, ctx in picked for i in range(k)])
        job.completions.add(it, "train", episodes)
        rewards = torch.tensor([[e.reward for e in episodes[g * k:(g + 1) * k]] for g in range(len(picked))])
        keep_groups = keep_mask(rewards).tolist() if picked else []
        for g, (task, index, _) in enumerate(picked):
            group, keep = episodes[g * k:(g + 1) * k], keep_groups[g]
            wins = sum(e.success for e in group)
            tally.add(task.name, successes=wins, rollouts=k, checked=1, accepted=int(keep), rejected=int(not keep),
                      truncated=sum(e.truncated for e in group), reward=sum(e.reward for e in group),
                      reward_sq=sum(e.reward ** 2 for e in group), turns=sum(e.turns for e in group),
                      tool_calls=sum(e.tool_calls for e in group), env_s=sum(e.env_seconds for e in group),
                      **Counter(f"failed_{e.reason}" for e in group if e.reason))
            job.sampler.record(task.name, index, wins, k)
            if keep and len(groups) < quota:
                groups.append(group)
    job.run.engine.train()
    return groups


def evaluate(job: RiptJob, it: int) -> dict:
    """Greedy success on each task's held-out contexts (at iteration `it`); counts summed over ranks (exact)."""
    run, r = job.run, job.run.cfg.ript
    jobs = [(job.tasks[n], c, 0) for n in job.mine
            for c in job.tasks[n].contexts("heldout", r.eval_contexts, run.cfg.seed)]
    run.engine.eval()
    episodes = run_episodes(job, job.policy(temperature=0.0), jobs)
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
            "last_sync": state.synced}, indent=2))


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
