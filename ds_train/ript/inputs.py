"""What a RIPT run checks before anything is written, on every rank of either side (trainer and rollout ranks):
its config (`check_ript_config`), its tasks, their sharding over the ranks that sample and the ranks that
evaluate, and the run's inputs (`RiptInputs`); the RunSpec of a ript run (`ript_spec`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from ds_train.config import RunConfig
from ds_train.errors import UserError
from ds_train.inputs import RunInputs, check_inputs, rank_config_check
from ds_train.plan.batch import rollout_update_steps
from ds_train.plan.parallel import plan_dims
from ds_train.ript.datatask import check_task_entries, split_for_ranks
from ds_train.ript.environments import load_tasks
from ds_train.ript.sharding import shard_tasks
from ds_train.ript.tasks import load_object
from ds_train.ript.vllm_engine import check_rollout_engine
from ds_train.run import RunSpec
from ds_train.train.probe import probe
from ds_train.checkpoint.rundir import RIPT


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
    rollout_tasks: dict  # with rollout ranks (ript.rollout_ranks_per_node): the tasks as they shard over them
    rollout_shards: list[list[str]]  # (without: `tasks` and `shards`, the same ranks sample and evaluate)
    quota: int  # the accepted groups a sampling rank gathers an iteration: ript.contexts_per_rank for each
    #            trainer's share, spread over the rollout ranks where there are

    @classmethod
    def check(cls, cfg: RunConfig, ds_config_path: str, env, spec: RunSpec) -> "RiptInputs":
        """`env`: this rank's; on either side of a split job (env.split) the checks are the trainers' world's, so
        every rank of the job finds the same."""
        r = cfg.ript
        check_ript_config(cfg)  # fail fast: before the model is read
        trainers = env.split.world("trainer") if env.split else env
        run = check_inputs(cfg, ds_config_path, rank_config_check(cfg, spec, trainers, ds_config_path), data=False)
        engine = check_rollout_engine(cfg, run.source.hf_config, trainers.world_size, trainers.local_world_size)
        every = load_tasks(cfg, run.source.tokenizer, run.source.hf_config)
        tasks, shards = cls.sharded(cfg, every, plan_dims(cfg.parallel, trainers.world_size).data)
        data = plan_dims(cfg.parallel, trainers.world_size).data
        rollout, quota = (tasks, shards), r.contexts_per_rank
        if env.split:
            ranks = env.split.world("rollout").world_size
            rollout, quota = cls.sharded(cfg, every, ranks), r.contexts_per_rank * data // ranks
            if r.contexts_per_rank * data % ranks:
                raise UserError(f"ript.contexts_per_rank={r.contexts_per_rank}: the {data} trainer(s) take "
                                f"{r.contexts_per_rank * data} groups an iteration, which {ranks} rollout ranks cannot "
                                f"share evenly; set contexts_per_rank to a multiple of "
                                f"{ranks // math.gcd(ranks, data)}")
        scripted = load_scripted(r.policy) if r.policy else None
        if env.split and scripted is None:
            check_weight_stream(cfg, run.source.hf_config)
        return cls(tasks, shards, scripted, run, engine, *rollout, quota)

    @classmethod
    def sharded(cls, cfg: RunConfig, tasks: dict, ranks: int) -> tuple[dict, list[list[str]]]:
        """The tasks as parts over `ranks` sampling ranks (a dataset split, ds_train/ript/datatask.py), and each
        rank's share of them."""
        parts = {part.name: part for task in tasks.values() for part in split_for_ranks(task, ranks)}
        return parts, shard_tasks(cls.costs(cfg, parts), ranks, cfg.ript.sharding, cfg.ript.allow_idle_ranks)

    @staticmethod
    def costs(cfg: RunConfig, tasks: dict) -> dict[str, float]:
        """A task's estimated cost: its training contexts x turns (a dataset: the prompts it has, up to
        ript.train_contexts)."""
        return {n: len(t.contexts("train", cfg.ript.train_contexts, cfg.seed)) * t.max_turns
                if hasattr(t, "prompt_ids") else cfg.ript.train_contexts * t.max_turns for n, t in tasks.items()}


def check_weight_stream(cfg: RunConfig, hf_config) -> None:
    """With rollout ranks: every weight the trainers will send (ds_train/model/gathered.py rollout_weights, in the
    model's in-memory names: LoRA merged, a MoE's experts as they are) has its place in the rollout ranks' model
    built from the config, and every parameter of that model is sent; walked on the meta device (no memory, no
    weights read), so a mismatch is one line before anything is written rather than the first meeting's."""
    import torch
    from transformers import AutoModelForCausalLM

    from ds_train.model.gathered import rollout_weights
    from ds_train.model.lora import apply_lora, enabled

    with torch.device("meta"):
        trainer = AutoModelForCausalLM.from_config(hf_config)
        rollout = dict(AutoModelForCausalLM.from_config(hf_config).named_parameters())
        if enabled(cfg.model.lora):
            trainer = apply_lora(trainer, cfg.model.lora, cfg.seed)
        sent = {name: tuple(t.shape) for name, t in rollout_weights(trainer)}
    where = "ript.rollout_ranks_per_node"
    extra = sorted(set(sent) - set(rollout))
    missing = sorted(set(rollout) - set(sent))
    wrong = sorted(n for n in set(sent) & set(rollout) if sent[n] != tuple(rollout[n].shape))
    for names, what in ((extra, "have no place in the rollout ranks' model"),
                        (missing, "of the rollout ranks' model would never be sent"), (wrong, "change shape")):
        if names:
            raise UserError(f"{where}: {len(names)} of the policy's weights {what} ({', '.join(names[:3])}"
                            f"{', ...' if len(names) > 3 else ''}; {type(trainer).__name__}); set "
                            f"rollout_ranks_per_node=0 (every rank generates)")


def load_scripted(spec: str):
    """ript.policy `module:Class` -> an instance with act(task, context, transcript, index) -> str."""
    policy = load_object(spec, "ript.policy")
    if not callable(getattr(policy, "act", None)):
        raise UserError(f"ript.policy: {spec!r} has no act(task, context, transcript, index) method")
    return policy
