"""The RIPT loop: `deepspeed --num_gpus 2 --module ds_train ript --config C --ds-config D`.

Per iteration, every rank samples its own tasks' contexts until it has its quota of accepted ones
(0 < successes < K), the accepted contexts of all ranks reach early_stop_fraction of the total quota,
or it has checked its cap; then all ranks update the policy through the DeepSpeed engine on the
same number of (padded) micro-batches. Every count that is logged is summed over ranks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_train import checkpoint, dist
from ds_train.batch import BatchPlan, plan_batch
from ds_train.config import RunConfig, save_config
from ds_train.engine import initialize, read_ds_template, render_ds_config, zero_stage
from ds_train.errors import UserError
from ds_train.fs import file_lock, write_atomic
from ds_train.metrics import build_logger, build_progress, build_rank_log, rewind_jsonl
from ds_train.ript.rloo import clipped_policy_loss, keep_mask, rloo_advantages
from ds_train.ript.rollout import Episode, model_policy, rollout, scripted_policy
from ds_train.ript.sampler import ContextSampler, Tally, merge_states
from ds_train.ript.sharding import format_shards, shard_tasks
from ds_train.ript.tasks import load_task

CONSOLE_KEYS = ("ript/success_rate", "ript/accepted", "ript/rejected", "ript/checked", "policy/loss",
                "policy/clip_frac", "perf/rollouts_per_s", "eval/success")


@dataclass
class RiptRun:
    cfg: RunConfig
    env: dist.DistEnv
    plan: BatchPlan
    run_dir: Path
    engine: Any
    tokenizer: Any
    tasks: dict  # name -> task, every task (each rank owns some)
    shards: list[list[str]]
    sampler: ContextSampler
    ds_config: dict
    dtype: str
    logger: Any
    rank_log: Any
    say: Any
    resume: checkpoint.ResumePoint | None = None
    scripted: Any = None  # ript.policy, when a script acts instead of the model

    @property
    def mine(self) -> list[str]:
        return self.shards[self.env.rank]

    @property
    def zero3(self) -> bool:
        return zero_stage(self.ds_config) == 3


def init_model_dir(path: str, run_dir: Path) -> str:
    """model.path as a Hugging Face directory: a ds_train run directory is exported once first."""
    from ds_train.export import export

    src = Path(path)
    if (src / "config.json").is_file():
        return path
    if not any((src / name).exists() for name in ("checkpoints", "latest", checkpoint.STATE_FILE)):
        raise UserError(f"model.path: {path!r} is neither a Hugging Face directory (config.json) nor a "
                        f"ds_train run or checkpoint directory")
    out = run_dir / "init_model"
    run_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(run_dir / ".init_model.lock"):
        if not (out / "config.json").is_file():
            export(src, out)
    return str(out)


def build(cfg: RunConfig, ds_config_path: str, env: dist.DistEnv) -> RiptRun:
    """Everything before the first iteration; bad input fails here, before anything is written."""
    import torch
    from deepspeed.accelerator import get_accelerator

    from ds_train.data import load_tokenizer
    from ds_train.model import build_hf_config, build_model, resolve_dtype
    from ds_train.trainer import check_resume, save_hf_metadata, seed_everything

    r = cfg.ript
    if not cfg.model.path:
        raise UserError("model.path: RIPT starts from a trained policy: a Hugging Face directory or a "
                        "ds_train run directory (recipes/ript_sft.yaml makes one)")
    tasks = {}
    for spec in r.tasks:
        task = load_task(str(spec))
        tasks[task.name] = task
    shards = shard_tasks({n: r.train_contexts * t.max_turns for n, t in tasks.items()}, env.world_size,
                         r.sharding, r.allow_idle_ranks)
    scripted = load_scripted(r.policy) if r.policy else None
    template = read_ds_template(ds_config_path)
    plan = plan_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size, env.world_size,
                      cfg.train.seq_len)
    rows = r.contexts_per_rank * r.rloo_batch_size
    if rows % plan.sequences_per_rank:
        raise UserError(f"ript: contexts_per_rank x rloo_batch_size = {rows} rollouts per rank must be a "
                        f"multiple of train.global_batch_size / world size = {plan.sequences_per_rank}; "
                        f"set train.global_batch_size to {rows * env.world_size} (one optimizer step per "
                        f"iteration) or that divided by the steps you want")
    run_dir = Path(cfg.output_dir)
    model_path = init_model_dir(cfg.model.path, run_dir)
    tokenizer = load_tokenizer(model_path)
    model_cfg = dataclasses.replace(cfg.model, path=model_path)
    hf_config = build_hf_config(model_cfg, len(tokenizer), cfg.train.seq_len)
    accel = get_accelerator()
    dtype = resolve_dtype(cfg.model.dtype, accel.device_name(), accel.is_bf16_supported())
    steps = r.iterations * r.ppo_epochs * rows // plan.sequences_per_rank  # at most: the LR schedule's length
    sched_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=steps))
    ds_config = render_ds_config(template, sched_cfg, plan, dtype, hf_config.hidden_size, cfg.optim.lr,
                                 accel.device_name() == "cuda", source=str(ds_config_path))
    resume = checkpoint.find_resume(cfg.checkpoint.resume, run_dir / "checkpoints")
    changes = check_resume(resume, cfg)
    if resume and resume.state.get("kind") != "ript":
        raise UserError(f"{resume.load_dir / resume.tag}: not a RIPT checkpoint; use another output_dir")
    if resume and resume.state["world_size"] != env.world_size:
        raise UserError(f"{resume.load_dir / resume.tag}: saved with {resume.state['world_size']} ranks; "
                        f"resume RIPT with the same world size (the task sharding and RNG are per rank)")

    dist.init(env)
    seed_everything(cfg.seed)
    engine = initialize(build_model(model_cfg, hf_config, ds_config, cfg.seed).model, ds_config)
    torch.manual_seed(cfg.seed * 1000 + env.rank)  # each rank samples its own rollouts
    sampler = ContextSampler([tasks[n] for n in shards[env.rank]], r.train_contexts, cfg.seed,
                             r.skip_solved, r.retest_after)
    say = print if env.is_main else (lambda *a, **k: None)
    run_dir.mkdir(parents=True, exist_ok=True)
    if env.is_main:  # hf_model/: what `ds-train export` adds this run's weights to
        save_config(cfg, run_dir / "config.yaml")
        (run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2))
        save_hf_metadata(hf_config, tokenizer, run_dir / "hf_model")
    for change in changes:
        say(f"resuming with a changed setting: {change}")
    say(format_shards(shards, {n: r.train_contexts * t.max_turns for n, t in tasks.items()}))
    say(f"{plan.describe()}; K={r.rloo_batch_size}; quota {r.contexts_per_rank} contexts per rank; "
        f"dtype {dtype}; ZeRO stage {zero_stage(ds_config)}; policy {r.policy or model_path}")
    if resume and env.is_main:  # iterations after the checkpoint run again: drop their old lines
        rewind_jsonl(run_dir / "metrics.jsonl", int(resume.state["iteration"]))
    logger = build_logger(env.is_main, run_dir, cfg.log.wandb, cfg.log.wandb_project, cfg.to_dict(),
                          console_keys=CONSOLE_KEYS)
    return RiptRun(cfg, env, plan, run_dir, engine, tokenizer, tasks, shards, sampler, ds_config, dtype,
                   logger, build_rank_log(run_dir, env.rank), say, resume, scripted)


def load_scripted(spec: str):
    """ript.policy `module:Class` -> an instance with act(task, context, transcript, index) -> str."""
    import importlib

    module, _, cls = spec.partition(":")
    try:
        policy = getattr(importlib.import_module(module), cls)()
    except (ImportError, AttributeError, ValueError) as e:
        raise UserError(f"ript.policy: cannot load {spec!r}: {e}") from None
    if not callable(getattr(policy, "act", None)):
        raise UserError(f"ript.policy: {spec!r} has no act(task, context, transcript, index) method")
    return policy


def _policy(run: RiptRun, temperature: float):
    if run.scripted is not None:
        return scripted_policy(run.scripted, run.tokenizer)
    return model_policy(run.engine.module, run.tokenizer, run.cfg.ript.max_new_tokens, temperature, run.zero3)


def run_episodes(run: RiptRun, act, jobs: list) -> list[Episode]:
    """Rollouts of this rank's jobs. Under ZeRO-3 generation is a collective: every rank makes the
    same number of policy calls (batches x turns), with dummy rows where it has nothing to do."""
    r = run.cfg.ript
    size = r.rollout_contexts * r.rloo_batch_size
    if not run.zero3 or r.policy:  # scripted policies make no collective calls
        return rollout(act, run.tokenizer, jobs, size)
    batches = int(dist.all_reduce_max([float(math.ceil(len(jobs) / size))])[0])
    turns = max(t.max_turns for t in run.tasks.values())
    episodes = []
    for b in range(batches):
        part = jobs[b * size:(b + 1) * size]
        episodes += rollout(act, run.tokenizer, part, size, turns=turns)
    return episodes


def sample(run: RiptRun, act, tally: Tally) -> list[list[Episode]]:
    """Dynamic rollout sampling: this rank's accepted groups (each K episodes of one context)."""
    import torch

    r = run.cfg.ript
    k, quota = r.rloo_batch_size, r.contexts_per_rank
    active = sum(1 for s in run.shards if s)
    target = math.ceil(r.early_stop_fraction * quota * active)
    groups: list[list[Episode]] = []
    checked = 0
    while True:
        done = not run.mine or len(groups) >= quota or checked >= r.max_contexts_checked
        accepted, busy = dist.all_reduce_sum([float(min(len(groups), quota)), float(not done)])
        if busy == 0 or accepted >= target:
            break
        picked = [] if done else run.sampler.next(min(r.rollout_contexts, r.max_contexts_checked - checked), tally)
        checked += len(picked)
        jobs = [(task, ctx, i) for task, _, ctx in picked for i in range(k)]
        episodes = run_episodes(run, act, jobs)
        rewards = torch.tensor([[float(e.success) for e in episodes[g * k:(g + 1) * k]] for g in range(len(picked))])
        keep_groups = keep_mask(rewards).tolist() if picked else []
        for g, (task, index, _) in enumerate(picked):
            group, keep = episodes[g * k:(g + 1) * k], keep_groups[g]
            wins = sum(e.success for e in group)
            tally.add(task.name, successes=wins, rollouts=k, checked=1, accepted=int(keep), rejected=int(not keep))
            run.sampler.record(task.name, index, wins, k)
            if keep and len(groups) < quota:
                groups.append(group)
    return groups


def _token_logp(engine, ids):
    import torch

    logits = engine(input_ids=ids[:, :-1], use_cache=False).logits.float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def update(run: RiptRun, groups: list[list[Episode]], iteration: int) -> list[float]:
    """PPO epochs over the accepted rollouts; every rank runs the same number of engine steps.

    The loss of an optimizer step is the clipped surrogate summed over the valid tokens of all ranks
    divided by their global count (the engine averages over ranks and accumulation steps, so each
    rank's part is scaled by world x accumulation). Returns summed stats for the log.
    """
    import torch

    r, plan, engine = run.cfg.ript, run.plan, run.engine
    rows = [e for g in groups for e in g]
    per_step = plan.sequences_per_rank
    n_steps = int(dist.all_reduce_max([float(math.ceil(len(rows) / per_step))])[0])
    if n_steps == 0:
        return [0.0] * 5
    width = int(dist.all_reduce_max([float(max((len(e.ids) for e in rows), default=2))])[0])
    n = n_steps * per_step
    pad = run.tokenizer.eos_token_id
    ids = torch.full((n, width), pad, dtype=torch.long)
    mask = torch.zeros((n, width - 1))
    adv = torch.zeros(n)
    if groups:
        rewards = torch.tensor([[float(e.success) for e in g] for g in groups])
        adv[:len(rows)] = rloo_advantages(rewards).flatten()
    for i, e in enumerate(rows):  # right padding: causal attention never looks at it
        ids[i, :len(e.ids)] = torch.tensor(e.ids)
        mask[i, :len(e.ids) - 1] = torch.tensor(e.action_mask[1:], dtype=torch.float)
    ids = ids.to(engine.device)
    micro = plan.micro_batch_size
    engine.eval()
    with torch.no_grad():
        old = torch.cat([_token_logp(engine, ids[i:i + micro]) for i in range(0, n, micro)])
    engine.train()
    stats = torch.zeros(5, dtype=torch.float64)  # loss x tokens, tokens, clipped tokens, ratio sum, adv x tokens
    for epoch in range(r.ppo_epochs):
        order = list(range(len(rows)))
        random.Random(f"{run.cfg.seed}:{iteration}:{epoch}:{run.env.rank}").shuffle(order)
        order += list(range(len(rows), n))  # padding rows last
        counts = [float(mask[order[s * per_step:(s + 1) * per_step]].sum()) for s in range(n_steps)]
        global_counts = dist.all_reduce_sum(counts)
        for s in range(n_steps):
            scale = plan.world_size * plan.grad_accum_steps / max(global_counts[s], 1.0)
            for m in range(plan.grad_accum_steps):
                idx = order[s * per_step + m * micro: s * per_step + (m + 1) * micro]
                logp = _token_logp(engine, ids[idx])
                loss, st = clipped_policy_loss(logp, old[idx], adv[idx].to(logp.device),
                                               mask[idx].to(logp.device), r.clip_low, r.clip_high)
                engine.backward(loss * scale)
                engine.step()
                weighted_adv = float((adv[idx][:, None] * mask[idx]).sum())
                stats += torch.tensor([float(loss.detach()), st["tokens"], st["clipped_tokens"], st["ratio_sum"],
                                       weighted_adv], dtype=torch.float64)
    return stats.tolist()


def evaluate(run: RiptRun) -> dict:
    """Greedy success on each task's held-out contexts; counts summed over ranks (exact)."""
    r = run.cfg.ript
    act = _policy(run, temperature=0.0)
    jobs = [(run.tasks[n], c, 0) for n in run.mine for c in run.tasks[n].contexts("heldout", r.eval_contexts, run.cfg.seed)]
    run.engine.eval()
    episodes = run_episodes(run, act, jobs)
    run.engine.train()
    names = sorted(run.tasks)
    local = {n: [0.0, 0.0] for n in names}
    for e in episodes:
        local[e.task.name][0] += e.success
        local[e.task.name][1] += 1
    flat = dist.all_reduce_sum([v for n in names for v in local[n]])
    per_task = {n: {"successes": int(flat[2 * i]), "episodes": int(flat[2 * i + 1]),
                    "success_rate": flat[2 * i] / flat[2 * i + 1] if flat[2 * i + 1] else 0.0}
                for i, n in enumerate(names)}
    wins, total = sum(t["successes"] for t in per_task.values()), sum(t["episodes"] for t in per_task.values())
    return {"success_rate": wins / total if total else 0.0, "successes": wins, "episodes": total,
            "per_task": per_task}


def _eval_metrics(result: dict) -> dict:
    out = {"eval/success": result["success_rate"]}
    out |= {f"eval/{n}/success": t["success_rate"] for n, t in result["per_task"].items()}
    return out


def save(run: RiptRun, iteration: int, state: dict) -> None:
    """Weights, optimizer and RNG per rank (DeepSpeed); the samplers of all ranks in the state."""
    samplers = dist.all_gather_object(run.sampler.state())
    full = {"kind": "ript", "step": iteration, "iteration": iteration, "zero_stage": zero_stage(run.ds_config),
            "dtype": run.dtype, "config": run.cfg.to_dict(),
            "ript": {**state, "sampler": merge_states(samplers, run.shards)}}
    tag = checkpoint.save(run.engine, run.run_dir / "checkpoints", iteration, full, run.env.rank,
                          run.env.world_size, run.cfg.checkpoint.keep)
    run.rank_log.info(f"saved checkpoint {tag}")


def write_results(run: RiptRun, state: dict) -> None:
    if run.env.is_main:
        write_atomic(run.run_dir / "ript_results.json", json.dumps({
            "iteration": state["iteration"], "world_size": run.env.world_size,
            "shards": {f"rank{r}": names for r, names in enumerate(run.shards)},
            "eval": state["evals"][-1] if state["evals"] else None, "evals": state["evals"],
            "train_counts": state["totals"]}, indent=2))


def ript(cfg: RunConfig, ds_config_path: str) -> dict:
    run = build(cfg, ds_config_path, dist.detect_env())
    state = {"iteration": 0, "evals": [], "totals": Tally(list(run.tasks)).as_dict()}
    if run.resume:
        saved = checkpoint.load(run.engine, run.resume, run.env.rank, run.env.world_size)
        state = {k: saved["ript"][k] for k in ("iteration", "evals", "totals")}
        run.sampler.load_state(saved["ript"]["sampler"])
        run.say(f"resumed from {run.resume.load_dir / run.resume.tag} at iteration {state['iteration']}")
    else:
        result = evaluate(run)
        state["evals"].append({"iteration": 0, **result})
        run.logger.log(_eval_metrics(result), 0)
        write_results(run, state)
    state = loop(run, state)
    run.logger.close()
    dist.barrier()
    dist.release_shared_memory(run.env)
    return state


def loop(run: RiptRun, state: dict) -> dict:
    """Iterations: sample (dynamic), update, maybe sync + log, maybe evaluate, maybe save."""
    r, c = run.cfg.ript, run.cfg
    names = sorted(run.tasks)
    act = _policy(run, r.temperature)
    progress = build_progress(run.env.is_main, c.log.progress, r.iterations, state["iteration"])
    window, window_t, window_rollout_s, policy_stats = Tally(names), time.perf_counter(), 0.0, [0.0] * 5
    for it in range(state["iteration"] + 1, r.iterations + 1):
        t0 = time.perf_counter()
        run.engine.eval()
        groups = sample(run, act, window)
        window_rollout_s += time.perf_counter() - t0
        run.engine.train()
        policy_stats = [a + b for a, b in zip(policy_stats, update(run, groups, it))]
        state["iteration"] = it
        progress.update()
        last = it == r.iterations
        metrics: dict = {}
        if it % r.sync_every == 0 or last:  # the window's counts, summed over ranks
            run.rank_log.info(f"iteration {it} counts {json.dumps(window.as_dict())}")  # this rank's own
            counts = Tally.from_vector(names, dist.all_reduce_sum(window.vector()))
            rollout_s = dist.all_reduce_max([window_rollout_s])[0]
            state["totals"] = _add_counts(state["totals"], counts)
            metrics = counts.metrics() | _policy_metrics(dist.all_reduce_sum(policy_stats)) | {
                "perf/rollouts_per_s": counts.total("rollouts") / max(rollout_s, 1e-9),
                "perf/iteration_s": (time.perf_counter() - window_t) / r.sync_every}
            progress.set_postfix_str(f"success {metrics['ript/success_rate']:.3f}")
            window, window_t, window_rollout_s, policy_stats = Tally(names), time.perf_counter(), 0.0, [0.0] * 5
        if _eval_due(it, r.eval_every, last):
            result = evaluate(run)
            state["evals"].append({"iteration": it, **result})
            metrics |= _eval_metrics(result)
            write_results(run, state)
        if metrics:
            run.logger.log(metrics, it)
        if (c.checkpoint.every and it % c.checkpoint.every == 0) or (last and c.checkpoint.save_final):
            save(run, it, state)
    progress.close()
    if state["evals"]:
        first, final = state["evals"][0], state["evals"][-1]
        run.say(f"held-out success {first['success_rate']:.3f} (iteration {first['iteration']}) -> "
                f"{final['success_rate']:.3f} (iteration {final['iteration']}); "
                f"results in {run.run_dir / 'ript_results.json'}")
    return state


def _add_counts(totals: dict, counts: Tally) -> dict:
    return {n: {k: v + counts.counts[n][k] for k, v in c.items()} for n, c in totals.items()}


def _eval_due(it: int, every: int, last: bool) -> bool:
    return last or (every > 0 and it % every == 0)


def _policy_metrics(pol: list[float]) -> dict:
    loss, tokens, clipped, ratio, adv = pol
    if tokens == 0:
        return {"policy/tokens": 0}
    return {"policy/loss": loss / tokens, "policy/tokens": tokens, "policy/clip_frac": clipped / tokens,
            "policy/ratio": ratio / tokens, "policy/advantage": adv / tokens}
