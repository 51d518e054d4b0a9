"""lm-evaluation-harness tasks scored on the live model during a run (the benchmarks section), at the steps (train)
or iterations (ript) that are theirs.

How the ranks take part: every rank walks the model's weights together (ds_train/model/gathered.py: ZeRO-3's and
AutoTP's shards gathered one module at a time, LoRA merged), rank 0 keeps them, in the run's dtype (model.dtype:
bf16 stays bf16, as `ds-train export` writes it), builds the model from them in memory as `lm_eval --model hf`
loads an export (transformers' from_pretrained, given the weights: nothing is written, so no copy is left in the
run directory) and scores it in its process through lm_eval's Hugging Face backend (ds_train/benchmarks.py). The
other ranks wait meanwhile, outside any collective: rank 0 posts the scores in the rendezvous store, and they wait
at most benchmarks.wait_s for them (not dist.timeout_s), then end the run in one line naming the scoring. The walk
is phase `benchmarks` of the heartbeats; rank 0's phase `scoring` moves with each forward of the scoring model, so
the watchdog times each forward, not the whole scoring; the others' `wait-scores` it does not time.

A scoring that raises on rank 0 (a task's code, lm_eval, memory) is a skipped scoring: named in the console, as
`benchmarks/skipped` in the metrics and with its reason in results.json; the run goes on. The loops commit a
step's checkpoint before its scoring, so a scoring can never lose the step; a run resumed from that checkpoint
scores the step again where the checkpoint does not hold its scores. Every checkpoint after keeps the scorings
so far: a resumed run's results file lists the scorings before the resume too. So the scores are those `lm_eval`
gives on `ds-train export` of the same step, at the cost of ~2x the model in rank 0's host memory and a copy on
its device (ds_train/plan/memory.py scoring_bytes), and its time. Rank 0 logs them under each task's own metric
names (bench/<task>/<metric>,<filter>).
"""

from __future__ import annotations

import json
import time

from ds_train import dist
from ds_train.benchmarks import (Tasks, check_chat_template, evaluate, kept_generators, metrics, resolve,
                                 scoring_memory_problem, write_samples)
from ds_train.errors import AgreedError, Stalled
from ds_train.fs import write_atomic
from ds_train.model.gathered import policy_weights
from ds_train.model.lora import base_model
from ds_train.model.ulysses import plain_attention
from ds_train.observe.metrics import Interval

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
POLL_S = 0.2  # how often a waiting rank looks for rank 0's scores


class Benchmarks:
    """The benchmarks section's component: `maybe_score(step)` scores where the step is its (every N, the last
    one with at_end, the start with at_start); `scores` holds every scoring of the run, by step (a resumed run's
    from its checkpoint), the same on every rank."""

    def __init__(self, run, last: int, scores: list | None = None, channel=None):
        """`channel`: the side channel the waiting ranks read rank 0's scores from (None: opened here when
        there are several ranks)."""
        self.run, self.cfg = run, run.cfg.benchmarks
        self.interval = Interval(self.cfg.every or 0, last if self.cfg.at_end else -1)
        self.tasks: Tasks | None = resolve(self.cfg.tasks) if self.cfg.tasks else None  # checked before launch
        self.scores: list[dict] = scores if scores is not None else []  # a resumed run's so far (its checkpoint's)
        if self.tasks is not None and run.tokenizer is not None:  # every rank: the same tokenizer, the same verdict
            check_chat_template(run.tokenizer, self.cfg.apply_chat_template)
        self._channel = channel
        if self.tasks is not None:
            self.check_memory()

    def check_memory(self) -> None:
        """Before the first step (every rank): rank 0's scoring fits what its host and device have free now,
        beside the engine's states (ds_train/plan/memory.py scoring_bytes), or every rank ends in rank 0's line."""
        run = self.run
        problem = None
        if run.env.is_main:
            on_gpu = run.engine.device.type == "cuda"
            problem = scoring_memory_problem(run.n_params, run.dtype, on_gpu, host_available(),
                                             device_free(run.engine.device) if on_gpu else None)
        problem = dist.broadcast_object(problem)
        if problem:
            raise AgreedError(problem)

    def due(self, step: int) -> bool:
        return self.tasks is not None and (step in self.interval if step > 0 else self.cfg.at_start)

    def maybe_score(self, step: int, then=None) -> dict:
        """`then`: what the owner does after a scoring (ript: rewrite ript_results.json)."""
        if not self.due(step):
            return {}
        out = self.score(step)
        if then is not None:
            then()
        return out

    def resume(self, step: int, then=None) -> dict:
        """A run resumed at `step` (every rank): its checkpoint, committed before the scorings of its step, holds
        those before; rank 0's file of the scorings (benchmarks/scores.json) adds the ones after, up to `step`,
        and every rank takes rank 0's list. The step's own scoring is scored again where neither holds it, or holds
        it skipped (a scoring that raised, or never finished). Rank 0's metrics of that scoring."""
        if self.tasks is None or step == 0:
            return {}
        if self.run.env.is_main:
            self.scores[:] = merged(self.scores, read_scores(self.run.run_dir), step)
        self.scores[:] = dist.broadcast_object(self.scores)
        done = next((s for s in self.scores if s["step"] == step), None)
        if not self.due(step) or done is not None and "skipped" not in done:
            return {}
        self.scores[:] = [s for s in self.scores if s["step"] != step]
        self.run.watch()  # before the loop arms it: the scoring is watched as a step is
        return self.score(step)

    def score(self, step: int) -> dict:
        """Every rank: the weights walked together; rank 0 scores them (a failure is a skipped scoring); the
        others wait for its scores. Rank 0's metrics."""
        run = self.run
        if step == 0:  # the start's scoring, before the loop arms the watchdog: watched as a step is
            run.watch()
        run.beat(step, "benchmarks")
        start = time.perf_counter()
        main = run.env.is_main
        dtype = _torch_dtype(run.dtype)
        kept = {}
        for name, tensor in policy_weights(run.engine.module):
            if main:
                kept[name] = tensor.detach().to("cpu", dtype if tensor.is_floating_point() else tensor.dtype)
        out = {}
        if main:
            try:  # each forward of the scoring model is progress (the watchdog times rank 0's phase `scoring`)
                with plain_attention(), kept_generators():  # under Ulysses: it attends alone, as lm_eval's does
                    results = self._evaluate(kept, step, dtype)
                scores, record = metrics(results), {}
                if self.cfg.log_samples and results.get("samples"):
                    record["samples"] = str(write_samples(results, run.run_dir / "benchmarks", f"step_{step:08d}"))
            except Exception as e:  # noqa: BLE001 - any fault of the scoring ends the scoring, not the run
                reason = _reason(e)
                run.rank_log.exception(f"benchmarks: the scoring of {run.spec.unit} {step} failed")
                run.say(f"benchmarks: the scoring of {run.spec.unit} {step} failed and is skipped ({reason}); the "
                        f"run goes on (`ds-train eval {run.run_dir} --tag TAG` scores a saved tag afterwards)")
                scores, record = {}, {"skipped": reason}
            self.scores.append({"step": step, "scores": scores, **record})
            write_scores(run.run_dir, self.scores)  # what a resume from the checkpoint before the scoring takes
            out = scores | ({"benchmarks/skipped": 1} if "skipped" in record else {}) | {
                "perf/benchmarks_s": round(time.perf_counter() - start, 3)}
        del kept
        run.beat(step, "wait-scores")  # the watchdog's untimed phase: the others wait at most benchmarks.wait_s
        self.scores[:] = self._share(step)  # every rank's checkpoint keeps them
        return out

    def _share(self, step: int) -> list:
        """Rank 0's scorings on every rank, through the rendezvous store: the others wait outside any collective,
        at most benchmarks.wait_s (dist.timeout_s is for collectives; a scoring may be longer)."""
        if self.run.env.world_size == 1:
            return self.scores
        if self._channel is None:
            from ds_train.dist.store import side_channel

            self._channel = side_channel(self.run.env)
        key = f"benchmarks/scores/{step}"
        if self.run.env.is_main:
            self._channel.set(key, json.dumps(self.scores))
            return self.scores
        return json.loads(wait_for(self._channel, key, self.cfg.wait_s, lambda: self._late(step)))

    def _late(self, step: int) -> Stalled:
        run, wait_s = self.run, self.cfg.wait_s
        return Stalled(f"benchmarks: rank {run.env.rank} waited benchmarks.wait_s={wait_s:g} s for rank 0's scoring of "
                       f"{run.spec.unit} {step} ({', '.join(self.tasks.names)}, limit {self.cfg.limit or 'none'}); "
                       f"raise benchmarks.wait_s, lower benchmarks.limit or score fewer tasks, or score the run's "
                       f"tags afterwards with `ds-train eval {run.run_dir}`")

    def _evaluate(self, weights: dict, step: int, dtype) -> dict:
        """The model rank 0 scores: built from the gathered weights in memory by transformers' own loading (the
        checkpoint's names mapped onto the model's as from an export's files), in `dtype`, on rank 0's device."""
        import copy

        import torch
        from transformers import AutoModelForCausalLM

        run, model = self.run, base_model(self.run.engine.module)
        run.beat(step, "load")
        config = copy.deepcopy(model.config)
        config.dtype = dtype
        cls = type(model) if type(config) not in AutoModelForCausalLM._model_mapping else \
            AutoModelForCausalLM._model_mapping[type(config)]
        scored = cls.from_pretrained(None, config=config, state_dict=weights, dtype=dtype)
        weights.clear()  # the loaded model holds them now
        fault = self.cfg.debug_fault == step

        def forward(*_):
            run.beat(step, "scoring")
            if fault:
                raise RuntimeError(f"injected failure in the scoring of {run.spec.unit} {step} "
                                   f"(benchmarks.debug_fault)")

        scored.register_forward_pre_hook(forward)
        device = run.engine.device if run.engine.device.type == "cuda" else torch.device("cpu")
        try:
            return evaluate(scored.to(device), run.tokenizer, self.cfg, self.tasks, str(device))
        finally:
            del scored
            if device.type == "cuda":
                torch.cuda.empty_cache()


SCORES_FILE = "benchmarks/scores.json"  # in the run directory: every scoring of the run so far, rank 0's


def write_scores(run_dir, scores: list) -> None:
    path = run_dir / SCORES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(scores, indent=1) + "\n")


def read_scores(run_dir) -> list:
    """benchmarks/scores.json's scorings; none where it is missing or damaged (a resume then scores again)."""
    try:
        scores = json.loads((run_dir / SCORES_FILE).read_text())
    except (OSError, ValueError):
        return []
    return [s for s in scores if isinstance(s, dict) and isinstance(s.get("step"), int)] \
        if isinstance(scores, list) else []


def merged(saved: list, written: list, step: int) -> list:
    """The checkpoint's scorings (`saved`) and those of the file (`written`) made after it, up to the resumed
    `step`: the file's later ones scored weights the resume trains again."""
    have = {s["step"] for s in saved}
    return sorted(saved + [s for s in written if s["step"] <= step and s["step"] not in have],
                  key=lambda s: s["step"])


def host_available() -> float | None:
    """This host's available memory in bytes (/proc/meminfo's MemAvailable); None where it cannot be read."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def device_free(device) -> float:
    """What a new copy can take on `device`: free outside torch's allocator plus what it holds unused."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    return float(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def _torch_dtype(dtype: str):
    """The run's precision (Run.dtype: bf16, fp16, fp32) as torch's: the dtype of the scored copy and the export."""
    import torch

    return getattr(torch, TORCH_DTYPES.get(dtype, "float32"))


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def wait_for(channel, key: str, wait_s: float, late) -> str:
    """The value of `key` in the store once it is set, looking every POLL_S; `late()` raised after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        value = channel.get(key)
        if value is not None:
            return value
        if time.monotonic() >= deadline:
            raise late()
        time.sleep(POLL_S)
