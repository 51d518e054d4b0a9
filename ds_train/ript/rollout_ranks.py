"""Asynchronous RL, a rollout rank's whole run (ript.rollout_ranks_per_node): no DeepSpeed engine, no optimizer,
no files; the policy as a plain Hugging Face model on this rank's device, the environments, and the sampler of
its share of the tasks (sharded over the rollout ranks, as a colocated run shards them over its ranks).

It answers the trainers' word at each meeting on the bridge (ds_train/ript/feed.py says them): `batch i` (take
the weights of update i - 1, hand over batch i, then generate ahead what ript.max_staleness allows: batch i + k,
from those weights), `save` (hand over the batches it holds and its sampler's position), `resume` (take them
back), `stop`. Batch j is generated from the weights of update max(0, j - 1 - k) (ds_train/ript/batches.py) and
seeded by (seed, rank, j), so a resumed run generates what an uninterrupted one did.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from ds_train import dist
from ds_train.config import RunConfig
from ds_train.errors import UserError
from ds_train.model.build import resolve_dtype
from ds_train.ript.batches import source_version, to_wire
from ds_train.ript.inputs import RiptInputs, ript_spec
from ds_train.ript.rollout import Episode, model_policy, scripted_policy
from ds_train.ript.sampler import ContextSampler, Tally
from ds_train.ript.sampling import Generating, sample
from ds_train.topology import DistEnv, threads_per_rank


class _NoCompletions:
    """A rollout rank writes no completions.jsonl: trainer 0 writes what it receives."""

    def add(self, *_: Any) -> None:
        pass


@dataclass
class Held:
    """What a rollout rank holds between meetings: the batches generated ahead (batch -> its groups as plain data
    and its tally), the next batch to generate, and the version of the weights it holds (-1: none yet)."""

    queue: dict = field(default_factory=dict)
    next_batch: int = 1
    version: int = -1


def serve_rollouts(cfg: RunConfig, ds_config_path: str, env: DistEnv) -> dict:
    """A rollout rank (`env`: its side of the split job) from its checks to the trainers' `stop`."""
    import torch

    inputs = RiptInputs.check(cfg, ds_config_path, env, ript_spec(cfg))  # the trainers' checks, the same verdicts
    job = env.split.job
    if os.environ.get("OMP_NUM_THREADS", "").strip() == "":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(threads_per_rank(os.environ, cores, job.local_world_size))
    dist.init(env, cfg.dist.timeout_s, cfg.dist.join_timeout_s)
    try:
        rollouts = RolloutRank(cfg, inputs, env)
        rollouts.serve()
    finally:
        dist.leave()
    return {"role": "rollout", "rank": env.rank, "batches": rollouts.held.next_batch - 1}


class RolloutRank:
    def __init__(self, cfg: RunConfig, inputs: RiptInputs, env: DistEnv):
        self.cfg, self.r, self.env = cfg, cfg.ript, env
        self.bridge = dist.sides()
        self.tokenizer = inputs.run.source.tokenizer
        self.tasks, shards = inputs.rollout_tasks, inputs.rollout_shards
        self.mine = shards[env.rank]
        self.sampler = ContextSampler([self.tasks[n] for n in self.mine], self.r.train_contexts, cfg.seed,
                                      self.r.skip_solved, self.r.retest_after, self.r.task_weighting)
        self.model = None if inputs.scripted is not None else build_policy(cfg, inputs.run.source.hf_config)
        self.act = (scripted_policy(inputs.scripted, self.tokenizer) if inputs.scripted is not None else
                    model_policy(self.model, self.tokenizer, self.r.max_new_tokens, self.r.temperature, False,
                                 list(self.tasks.values())))
        self.generating = Generating(self.r, self.tokenizer, self.tasks, lockstep=False, beat=lambda *_: None,
                                     ranks_with_tasks=sum(1 for s in shards if s), seed=cfg.seed, rank=env.rank,
                                     quota=inputs.quota)
        self.held = Held()
        self.waited_s = 0.0

    def serve(self) -> None:
        while True:
            t0 = time.perf_counter()
            word = self.bridge.broadcast()
            self.waited_s += time.perf_counter() - t0
            kind = word["kind"]
            if kind == "stop":
                return
            if kind == "resume":
                self.resume(word)
            elif kind == "save":
                self.bridge.gather({"queue": self.held.queue, "next_batch": self.held.next_batch,
                                    "sampler": self.sampler.state()})
            else:
                self.batch(word["batch"])

    def resume(self, word: dict) -> None:
        if word["sampler"] is not None:
            self.sampler.load_state(word["sampler"])
        if word["held"] is not None:
            mine = word["held"][self.env.rank]
            self.held.queue, self.held.next_batch = mine["queue"], mine["next_batch"]

    def batch(self, i: int) -> None:
        """Meeting i: the weights of update i - 1 in, batch i out, then the batches ahead."""
        k, last = self.r.max_staleness, self.r.iterations
        stale = i + k == self.r.debug_stale_iteration  # the fault: batch i + k from the weights this rank holds
        self.load_weights(keep=stale)
        if not stale:
            self.held.version = i - 1
        while self.held.next_batch <= i:  # k = 0 (or a start): batch i from these weights, the trainers waiting
            self.generate(self.held.next_batch)
        out = self.held.queue.pop(i)
        self.bridge.gather({**out, "waited_s": self.waited_s, "queue": len(self.held.queue)})
        self.waited_s = 0.0
        while self.held.next_batch <= min(i + k, last):
            self.generate(self.held.next_batch)

    def load_weights(self, keep: bool) -> None:
        """The weights the node's first trainer sends, into the policy (`keep`: read and dropped, the fault)."""
        import torch

        params = dict(self.model.named_parameters()) if self.model is not None else {}
        params.update(dict(self.model.named_buffers()) if self.model is not None else {})
        with torch.no_grad():
            for name, tensor in self.bridge.receive_weights():
                if keep or self.model is None:
                    continue
                if name not in params:
                    raise UserError(f"ript.rollout_ranks_per_node: the policy's weight {name} has no place in the "
                                    f"rollout ranks' {type(self.model).__name__}; set rollout_ranks_per_node=0")
                params[name].copy_(tensor)

    def generate(self, j: int) -> None:
        version = self.held.version  # the schedule's, or newer where a run extended past its last save catches up
        if version < source_version(j, self.r.max_staleness) and j != self.r.debug_stale_iteration:
            raise RuntimeError(f"batch {j} with weights {version}: the schedule says "
                               f"{source_version(j, self.r.max_staleness)}")
        tally = Tally(sorted(self.tasks))
        groups = sample(self.generating, self.sampler, bool(self.mine), self.act, tally, j, _NoCompletions())
        if self.model is not None:
            sampled_logprobs(self.model, [e for g in groups for e in g], self.tokenizer.eos_token_id)
        self.held.queue[j] = {"groups": [[to_wire(e, version) for e in g] for g in groups],
                              "tally": {n: c for n, c in tally.as_dict().items() if c.get("checked")}}
        self.held.next_batch = j + 1


def build_policy(cfg: RunConfig, hf_config):
    """The policy's architecture on this rank's device in the run's dtype; its weights come from the trainers."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from transformers import AutoModelForCausalLM

    accel = get_accelerator()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
        resolve_dtype(cfg.model.dtype, accel.device_name(), accel.is_bf16_supported()), torch.float32)
    model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=dtype)
    return model.to(dist.device()).eval()


def sampled_logprobs(model, episodes: list[Episode], pad: int, rows: int = 8) -> None:
    """Each episode's log-prob of every token under the weights that sampled it (0.0 on the prompt's first token),
    for the trainers' correction (ript.tis_cap) and their mismatch statistics."""
    import torch

    with torch.no_grad():
        for start in range(0, len(episodes), rows):
            chunk = episodes[start:start + rows]
            width = max(len(e.ids) for e in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            for n, e in enumerate(chunk):
                ids[n, :len(e.ids)] = torch.tensor(e.ids)
            ids = ids.to(next(model.parameters()).device)
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits.float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1).cpu()
            for n, e in enumerate(chunk):
                e.logprobs = [0.0] + logp[n, :len(e.ids) - 1].tolist()
