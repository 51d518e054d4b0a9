"""Run by tests/test_ript_trainer.py under the deepspeed launcher (2 ranks): ds_train's RIPT update
(ds_train/ript/update.py) on the rollouts the test wrote, for each loss aggregation mode, through a
real ZeRO-2 engine whose optimizer is SGD without momentum or clipping (a mode `M+tis`: M, with the rollouts'
engine log-probs and ript.tis_cap): each update leaves the weights
minus lr x the gradients the engine reduced over ranks and micro-batches. The modes run one after
another on the one engine; rank 0 writes the weights after each and its logged policy metrics (summed
over ranks) to OUT/update.pt.

    deepspeed --num_gpus 2 tests/ript_update_probe.py POLICY ROLLOUTS.json OUT
"""

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ds_train import dist, topology
from ds_train.config.file import build_config
from ds_train.engine import initialize
from ds_train.guard import NonFiniteGuard
from ds_train.ript.algorithms import PolicyStats
from ds_train.ript.rollout import Episode
from ds_train.ript.tasks import load_task
from ds_train.ript.trainer import ript_spec
from ds_train.ript.update import update


@dataclass
class UpdateRun:
    """What update() reads of a run: the real plan, engine, tokenizer and guard (its config is given)."""

    plan: Any
    engine: Any
    tokenizer: Any
    env: Any
    guard: Any
    token_group: Any = None

    @property
    def data_rank(self) -> int:  # data parallelism only: a rank's slice is its own
        return self.env.rank

    def beat(self, step: int, phase: str) -> None:
        pass


policy, rollouts, out = sys.argv[-3:]
spec = json.loads(Path(rollouts).read_text())
env = topology.detect_env()
dist.init(env)
task = load_task("copy")


def groups(tis: bool) -> list:
    """This rank's rollouts; with the rollout engine's log-probs for a `+tis` mode."""
    return [[Episode(task, None, i, e["ids"], e["action_mask"], reward=e["reward"],
                     logprobs=e["logprobs"] if tis else None) for i, e in enumerate(g)]
            for g in spec["ranks"][env.rank]]


def config(mode: str):
    """A mode `M` (ript.loss_agg_mode), or `M+tis`: M with truncated importance sampling at spec's tis_cap."""
    tis = {"rollout_engine": "vllm", "tis_cap": spec["tis_cap"]} if mode.endswith("+tis") else {}
    return build_config({"seed": 3, "model": {"path": policy, "dtype": "fp32"}, "train": spec["train"],
                         "ript": {**spec["ript"], "loss_agg_mode": mode.split("+")[0], **tis}})


cfg = config(spec["modes"][0])
plan = ript_spec(cfg).check(cfg, {}, env.world_size)[0].batch  # a data-parallel layout: no template needed
ds = {"train_batch_size": plan.global_batch_size, "train_micro_batch_size_per_gpu": plan.micro_batch_size,
      "gradient_accumulation_steps": plan.grad_accum_steps, "gradient_clipping": 0.0,  # DeepSpeed's default: 1.0
      "optimizer": {"type": "SGD", "params": {"lr": spec["lr"]}}, "zero_allow_untested_optimizer": True,
      "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 9}
engine = initialize(AutoModelForCausalLM.from_pretrained(policy), ds)
run = UpdateRun(plan, engine, AutoTokenizer.from_pretrained(policy), env,
                NonFiniteGuard("skip", 1, logging.getLogger("probe")))
results = {}
for it, mode in enumerate(spec["modes"], 1):  # one engine: each mode's update starts where the last one ended
    cfg = config(mode)
    stats = update(run, cfg.ript, groups(cfg.ript.tis_cap > 0), iteration=it, max_tokens=spec["max_tokens"],
                   seed=cfg.seed)
    summed = PolicyStats.from_reduced(dist.all_reduce_sum(stats.sums()), dist.all_reduce_max(stats.maxima()))
    results[mode] = {"metrics": summed.metrics(), "plan": [plan.grad_accum_steps, plan.data_parallel_size],
                     "weights": {k: v.detach().clone() for k, v in engine.module.state_dict().items()}}
if env.is_main:
    torch.save(results, Path(out) / "update.pt")
dist.release_shared_memory(env)
dist.shutdown()
