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
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from ds_train import dist
from ds_train.config import RunConfig
from ds_train.dist.store import side_channel
from ds_train.errors import PeerFailed, UserError
from ds_train.faults import step_fault
from ds_train.observe.reports import is_secondary
from ds_train.observe.watchdog import Heartbeat, Watchdog
from ds_train.run import StopRequest
from ds_train.model.build import resolve_dtype
from ds_train.plan.parallel import plan_dims
from ds_train.ript.batches import routes, share_out, source_version, to_wire
from ds_train.ript.inputs import RiptInputs, ript_spec
from ds_train.ript.rollout import Episode, model_policy, scripted_policy
from ds_train.ript.sampler import ContextSampler, Tally
from ds_train.ript.sampling import Generating, sample
from ds_train.topology import DistEnv, node_hosts, threads_per_rank


class _NoCompletions:
    """A rollout rank writes no completions.jsonl: trainer 0 writes what it receives."""

    def add(self, *_: Any) -> None:
        pass


@dataclass
class Held:
    """What a rollout rank holds between meetings: the batches generated ahead (batch -> its groups as plain data,
    by the data rank that takes them, and its tally), the next batch to generate, and the version of the weights it
    holds (-1: none yet)."""

    queue: dict = field(default_factory=dict)
    next_batch: int = 1
    version: int = -1


def serve_rollouts(cfg: RunConfig, ds_config_path: str, env: DistEnv) -> dict:
    """A rollout rank (`env`: its side of the split job) from its checks to the trainers' `stop`.

    It is watched as the trainers are (ds_train/observe/watchdog.py: its heartbeat in the store, after the
    trainers'), so a stall of its own is named. SIGTERM, SIGINT and SIGUSR1 are kept as the stop word and passed to
    the trainers through the store: they save at their next iteration (a `save` meeting this rank answers), then
    send `stop`. An error of its own is printed at once and published for the job's verdict, and the rank ends
    without the collective teardown (a barrier that the other ranks, waiting in a meeting, would never join)."""
    import torch

    inputs = RiptInputs.check(cfg, ds_config_path, env, ript_spec(cfg))  # the trainers' checks, the same verdicts
    job = env.split.job
    if os.environ.get("OMP_NUM_THREADS", "").strip() == "":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(threads_per_rank(os.environ, cores, job.local_world_size))
    dist.init(env, cfg.dist.timeout_s, cfg.dist.join_timeout_s)
    stop = StopRequest()
    watch = watch_rollout_rank(cfg, env, stop)
    try:
        rollouts = RolloutRank(cfg, inputs, env, watch.hb.beat)
        watch.arm()
        rollouts.serve()
    except BaseException as exc:
        raise failed(exc, watch) from None
    finally:
        stop.restore()
    watch.stop("ended")
    dist.leave()
    return {"role": "rollout", "rank": env.rank, "batches": rollouts.held.next_batch - 1}


def watch_rollout_rank(cfg: RunConfig, env: DistEnv, stop: StopRequest) -> Watchdog:
    """This rollout rank's heartbeat and watchdog: in the store after the trainers' ranks (its `slot`), no files."""
    split, job = env.split, env.split.job
    names = node_hosts()
    hb = Heartbeat(env.rank, job.node_rank, socket.gethostname(), names[job.node_rank] if job.node_rank < len(names)
                   else "", slot=split.world("trainer").world_size + env.rank, role="rollout", job_rank=job.rank,
                   fault=step_fault(cfg.watchdog.debug_fault, f"r{env.rank}"))
    return Watchdog(hb, None, job.world_size, cfg.watchdog.stall_s, cfg.watchdog.heartbeat_s, side_channel(job),
                    on_signal=stop.request, signalled=lambda: stop.signum).start()


def failed(exc: BaseException, watch: Watchdog) -> BaseException:
    """A rollout rank's error: said on its stderr first (a traceback for a fault, one line for a refusal; nothing
    for the loss of another rank, which the verdict names), then published; the job's verdict once a rank reported
    it, as the exception this rank ends with (exit 1, or the refusal's 2)."""
    hb = watch.hb
    who = f"ds-train[rollout rank {hb.rank}, job rank {hb.job_rank}]"
    if isinstance(exc, UserError):
        _say(f"{who}: error: {exc}")
    elif not is_secondary(exc):
        _say(f"{who}: error:\n" + "".join(traceback.format_exception(exc)).rstrip())
    verdict = watch.fail(exc)
    watch.stop("failed")
    if verdict is None:  # no store answers: what this rank said is all there is
        return exc if isinstance(exc, UserError) else PeerFailed(f"{type(exc).__name__}: {exc}", say=False)
    ended = PeerFailed(verdict, say=watch.verdict is not None)  # this rank wrote the verdict: it says it
    ended.exit_code = getattr(exc, "exit_code", 1)
    return ended


def _say(text: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class RolloutRank:
    def __init__(self, cfg: RunConfig, inputs: RiptInputs, env: DistEnv, beat=lambda *_: None):
        self.cfg, self.r, self.env, self.beat = cfg, cfg.ript, env, beat
        self.bridge = dist.sides()
        self.routes = routes(env.split, plan_dims(cfg.parallel, env.split.world("trainer").world_size))
        self.tokenizer = inputs.run.source.tokenizer
        self.tasks, shards = inputs.rollout_tasks, inputs.rollout_shards
        self.mine = shards[env.rank]
        self.sampler = ContextSampler([self.tasks[n] for n in self.mine], self.r.train_contexts, cfg.seed,
                                      self.r.skip_solved, self.r.retest_after, self.r.task_weighting)
        self.model = None if inputs.scripted is not None else build_policy(cfg, inputs.run.source.hf_config)
        act = (scripted_policy(inputs.scripted, self.tokenizer) if inputs.scripted is not None else
               model_policy(self.model, self.tokenizer, self.r.max_new_tokens, self.r.temperature, False,
                            list(self.tasks.values())))
        self.generating_batch = 0

        def watched(live):  # every policy call is progress: a slow batch is no hang, a stuck step is
            self.beat(self.generating_batch, "generate")
            return act(live)

        self.act = watched
        self.generating = Generating(self.r, self.tokenizer, self.tasks, lockstep=False, beat=beat,
                                     ranks_with_tasks=sum(1 for s in shards if s), seed=cfg.seed, rank=env.rank,
                                     quota=inputs.quota)
        self.held = Held()
        self.waited_s = 0.0
        self.meeting = 0

    def serve(self) -> None:
        while True:
            self.beat(self.meeting, "wait-trainers")  # untimed: the trainers' update (they are watched themselves)
            t0 = time.perf_counter()
            word = self.bridge.broadcast()
            self.waited_s += time.perf_counter() - t0
            kind = word["kind"]
            if kind == "stop":
                return
            if kind == "resume":
                self.resume(word)
            elif kind == "save":
                self.beat(self.meeting, "save")
                self.save()
            else:
                self.meeting = word["batch"]
                self.batch(word["batch"])

    def save(self) -> None:
        """Each trainer that takes this rank's groups gets its share of the batches held; trainer 0 their counts,
        the next batch and the sampler's position."""
        queue, counter = self.held.queue, self.routes.counter
        meta = {"next_batch": self.held.next_batch, "tallies": {b: q["tally"] for b, q in queue.items()},
                "sampler": self.sampler.state()}
        self.bridge.exchange({t: {"held": {b: q["shares"][d] for b, q in queue.items()} if d >= 0 else None,
                                  "meta": meta if t == counter else None}
                              for t, d in self.routes.destinations(self.env.rank).items()}, [])

    def resume(self, word: dict) -> None:
        """The sampler's position, and what this rank held at the checkpoint back from the trainers that kept it."""
        if word["sampler"] is not None:
            self.sampler.load_state(word["sampler"])
        if not word["held"]:
            return
        back = self.routes.givers_back(self.env.rank)
        got = self.bridge.exchange({}, list(back))
        meta = got[self.routes.counter]["meta"]
        self.held.queue = {b: {"shares": {d: got[t]["held"][b] for t, d in back.items() if d >= 0}, "tally": tally}
                           for b, tally in meta["tallies"].items()}
        self.held.next_batch = meta["next_batch"]

    def batch(self, i: int) -> None:
        """Meeting i: the weights of update i - 1 in, batch i out, then the batches ahead."""
        k, last = self.r.max_staleness, self.r.iterations
        self.beat(i, "receive-weights")
        # the fault (ript.debug_stale_iteration): this meeting's weights dropped, so batch i + k comes from the older
        # weights this rank holds, and is stamped with their version
        self.load_weights(keep=i + k == self.r.debug_stale_iteration)
        while self.held.next_batch <= i:  # k = 0 (or a start): batch i from these weights, the trainers waiting
            self.generate(self.held.next_batch)
        out = self.held.queue.pop(i)
        self.beat(i, "send-batch")
        meta = {"tally": out["tally"], "waited_s": self.waited_s, "queue": len(self.held.queue)}
        self.bridge.exchange({t: {"share": out["shares"][d] if d >= 0 else None,
                                  "meta": meta if t == self.routes.counter else None}
                              for t, d in self.routes.destinations(self.env.rank).items()}, [])
        self.waited_s = 0.0
        while self.held.next_batch <= min(i + k, last):
            self.generate(self.held.next_batch)

    def load_weights(self, keep: bool) -> None:
        """The weights the node's first trainer sends, into the policy, every parameter of it (`keep`: read and
        dropped, the fault); the version this rank holds is then the stream's (bridge.receive_weights refuses a
        stream that did not arrive whole)."""
        import torch

        params = dict(self.model.named_parameters()) if self.model is not None else {}
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in self.bridge.receive_weights():
                if keep or self.model is None:
                    continue
                if name not in params:
                    raise UserError(f"ript.rollout_ranks_per_node: the policy's weight {name} has no place in the "
                                    f"rollout ranks' {type(self.model).__name__}; set rollout_ranks_per_node=0")
                if params[name].shape != tensor.shape:
                    raise UserError(f"ript.rollout_ranks_per_node: the policy's weight {name} is "
                                    f"{tuple(tensor.shape)}, the rollout ranks' {tuple(params[name].shape)}; set "
                                    f"rollout_ranks_per_node=0")
                params[name].copy_(tensor)
                loaded.add(name)
        if keep:
            return
        missing = sorted(set(params) - loaded)
        if missing:
            raise UserError(f"ript.rollout_ranks_per_node: the trainers sent no weights for {len(missing)} of the "
                            f"rollout ranks' {len(params)} parameters ({', '.join(missing[:3])}"
                            f"{', ...' if len(missing) > 3 else ''}); set rollout_ranks_per_node=0")
        self.held.version = self.bridge.received["version"]

    def generate(self, j: int) -> None:
        version = self.held.version  # of the weights loaded last: the schedule's, or newer where a run extended past
        #                              its last save catches up
        if version < source_version(j, self.r.max_staleness) and j != self.r.debug_stale_iteration:
            raise RuntimeError(f"batch {j} with weights {version}: the schedule says "
                               f"{source_version(j, self.r.max_staleness)}")
        self.generating_batch = j
        tally = Tally(sorted(self.tasks))
        groups = sample(self.generating, self.sampler, bool(self.mine), self.act, tally, j, _NoCompletions())
        if self.model is not None:
            sampled_logprobs(self.model, [e for g in groups for e in g], self.tokenizer.eos_token_id,
                             self.r.temperature)
        wire = [[to_wire(e, version) for e in g] for g in groups]
        self.held.queue[j] = {"shares": share_out(wire, self.env.rank, len(self.routes.rollout_jobs), self.routes.data),
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


def sampled_logprobs(model, episodes: list[Episode], pad: int, temperature: float = 1.0, rows: int = 8) -> None:
    """Each episode's log-prob of every token under the weights that sampled it, at the temperature it was sampled
    at (0.0 on the prompt's first token), for the trainers' correction (ript.tis_cap) and their mismatch
    statistics: the trainers' log-probs are at the same temperature (ds_train/ript/update.py token_logp)."""
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
            if temperature > 0:
                logits = logits / temperature
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1).cpu()
            for n, e in enumerate(chunk):
                e.logprobs = [0.0] + logp[n, :len(e.ids) - 1].tolist()
