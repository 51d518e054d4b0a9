"""lm-evaluation-harness tasks scored on the live model during a run (the benchmarks section), at the steps (train)
or iterations (ript) that are theirs.

How the ranks take part: every rank walks the model's weights together (ds_train/model/gathered.py: ZeRO-3's and
AutoTP's shards gathered one module at a time, LoRA merged), rank 0 keeps them and writes them as a Hugging Face
directory beside the run (with the run's tokenizer), loads it as `lm_eval --model hf` loads an export and scores
it in its process through lm_eval's Hugging Face backend (ds_train/benchmarks.py); the other ranks wait meanwhile
(the walk is phase `benchmarks` of the heartbeats; rank 0's phase `scoring` moves with each forward of the scoring
model, so the watchdog times each forward, not the whole scoring; the others' `wait-scores` it does not time, as
the wait for rank 0's final export) and then take rank 0's scores, which every checkpoint keeps: a resumed
run's results file lists the scorings before the resume too. So the scores are those `lm_eval` gives on
`ds-train export` of the same step, at the cost of one whole copy of the model in rank 0's memory and its time.
Rank 0 logs them under each task's own metric names (bench/<task>/<metric>,<filter>).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from ds_train import dist
from ds_train.benchmarks import Tasks, evaluate, metrics, resolve
from ds_train.model.gathered import policy_weights
from ds_train.model.lora import base_model
from ds_train.model.ulysses import plain_attention
from ds_train.observe.metrics import Interval


class Benchmarks:
    """The benchmarks section's component: `maybe_score(step)` scores where the step is its (every N, the last
    one with at_end, the start with at_start); `scores` holds every scoring of the run, by step (a resumed run's
    from its checkpoint), the same on every rank."""

    def __init__(self, run, last: int, scores: list | None = None):
        self.run, self.cfg = run, run.cfg.benchmarks
        self.interval = Interval(self.cfg.every or 0, last if self.cfg.at_end else -1)
        self.tasks: Tasks | None = resolve(self.cfg.tasks) if self.cfg.tasks else None  # checked before launch
        self.scores: list[dict] = scores if scores is not None else []  # a resumed run's so far (its checkpoint's)

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

    def score(self, step: int) -> dict:
        """Every rank: the weights walked together; rank 0 scores them; the others wait. Rank 0's metrics."""
        run = self.run
        if step == 0:  # the start's scoring, before the loop arms the watchdog: watched as a step is
            run.watch()
        run.beat(step, "benchmarks")
        start = time.perf_counter()
        main = run.env.is_main
        kept = {}
        for name, tensor in policy_weights(run.engine.module):
            if main:
                kept[name] = tensor.detach().to("cpu")
        out = {}
        if main:  # each forward of the scoring model is progress (the watchdog times rank 0's phase `scoring`)
            with plain_attention():  # under Ulysses: the scoring model attends alone, as lm_eval's does
                scores = metrics(self._evaluate(kept, step))
            self.scores.append({"step": step, "scores": scores})
            out = scores | {"perf/benchmarks_s": round(time.perf_counter() - start, 3)}
        del kept
        run.beat(step, "wait-scores")  # untimed: the others wait for rank 0's scoring, however long
        self.scores[:] = dist.broadcast_object(self.scores)  # the others wait for it; every rank's checkpoint keeps it
        return out

    def _evaluate(self, weights: dict, step: int) -> dict:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        run, model = self.run, base_model(self.run.engine.module)
        where = Path(tempfile.mkdtemp(prefix=f"benchmarks_{step}_", dir=run.run_dir))
        try:
            run.beat(step, "save")  # the watchdog takes writing and reading as progress in these phases
            save_file({n: t.contiguous() for n, t in weights.items()}, str(where / "model.safetensors"),
                      metadata={"format": "pt"})
            model.config.save_pretrained(where)
            if run.tokenizer is not None:
                run.tokenizer.save_pretrained(where)
            run.beat(step, "load")
            scored = AutoModelForCausalLM.from_pretrained(where, dtype="auto")
            scored.register_forward_pre_hook(lambda *_: run.beat(step, "scoring"))
            device = run.engine.device if run.engine.device.type == "cuda" else torch.device("cpu")
            return evaluate(scored.to(device), run.tokenizer, self.cfg, self.tasks, str(device))
        finally:
            shutil.rmtree(where, ignore_errors=True)
