"""Training: `deepspeed --num_gpus 2 --module ds_train train --config C --ds-config D`.

`train` checks its inputs (ds_train/inputs.py: the model, the data prepared on first use), builds
the run (ds_train/start.py), and runs `train_loop`: next batch, step, and whatever each component
says is due (the non-finite guard, the metrics meter, the evaluator, the logger, the checkpointer).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ds_train import dist, topology
from ds_train.checkpoint.rundir import TRAIN
from ds_train.config import RunConfig
from ds_train.data.datasets import Datasets, rank_micro_batches, sequence_shard
from ds_train.data.examples import Batch
from ds_train.data.pairs import PreferenceData
from ds_train.faults import loss_fault
from ds_train.fs import write_atomic
from ds_train.guard import backward_step
from ds_train.inputs import check_inputs, rank_config_check
from ds_train.observe.metrics import Interval
from ds_train.observe.startup import StartupClock
from ds_train.run import Run, RunSpec
from ds_train.start import build_run
from ds_train.train.benchmarks import Benchmarks
from ds_train.train.losses import forward_losses
from ds_train.train.probe import probe
from ds_train.train.meters import ComputeClock, Evaluator, StepMeter
from ds_train.train.preference import preference_step
from ds_train.train.reference import PairReference, ReferenceSpec, preference_reference


def train_spec(cfg: RunConfig, keep_group: bool = False) -> RunSpec:
    return RunSpec(TRAIN, last=cfg.train.max_steps, steps=lambda plan: cfg.train.max_steps, keep_group=keep_group,
                   probe=functools.partial(probe, losses=cfg.data.format != "preference"))


def train(cfg: RunConfig, ds_config_path: str) -> dict:
    clock = StartupClock.begin()
    env, spec = topology.detect_env(), train_spec(cfg)
    inputs = check_inputs(cfg, ds_config_path, rank_config_check(cfg, spec, env, ds_config_path))
    clock.mark("inputs")
    with build_run(inputs, env, spec, clock=clock) as run:
        return run_training(run, inputs.data)


def run_training(run: Run, data: Datasets) -> dict:
    """The training of a built run: resume, the loop, the results (or nothing to do)."""
    cfg = run.cfg
    run.say(f"data: {len(data.train.tokens):,} train tokens in {cfg.data.dir}")
    if data.summary:
        run.say(f"data: {data.summary}")
    resumed = run.maybe_resume() or {}
    start = int(resumed.get("step", 0))
    if start >= cfg.train.max_steps:  # its results stay as they were
        results = run.paths.results(TRAIN)
        try:
            json.loads(results.read_text())
        except (OSError, ValueError):
            run.say(f"note: {results} is missing or damaged; the trained weights are whole in the checkpoint "
                    f"of step {start}: `ds-train export {run.run_dir} --out DIR` writes a model directory")
        run.say_outcome(f"nothing to do, already trained to step {start} >= train.max_steps={cfg.train.max_steps} "
                        f"(raise train.max_steps to continue, or set another output_dir)")
        return {"steps": start, "run_dir": str(run.run_dir.resolve())}
    preference = isinstance(data.train, PreferenceData)
    reference = preference_reference(run, ReferenceSpec.of(cfg), data, start) if preference else None
    if preference:
        run.mark_startup("reference")
    metrics = train_loop(run, data, start, cfg.train.max_steps, reference, resumed.get("benchmarks", []))
    return finish(run, metrics)


def train_loop(run: Run, data: Datasets, start: int, stop: int,
               reference: PairReference | None = None, scored: list | None = None) -> dict[str, Any]:
    """Steps start+1 .. stop: next batch, step, then each component acts if the step is its.
    `reference`: a preference run's (its steps are preference_step's); `scored`: the lm_eval scorings of the run
    before its resume (its checkpoint's)."""
    c, last = run.cfg, run.cfg.train.max_steps
    clock = ComputeClock(run.engine.device.type == "cuda")
    meter = StepMeter(run, Interval(c.log.every, last), clock, c.watchdog.straggler_ratio)
    evaluator = Evaluator(run, data.val, Interval(c.train.eval_every, last), c.train, c.dpo,
                          reference and reference.val)
    benchmarks = Benchmarks(run, last, list(scored or []))
    summary: dict[str, Any] = {}
    if start == 0 and benchmarks.due(0):  # the starting model's scores (benchmarks.at_start)
        run.logger.log(benchmarks.score(0), 0)
        run.mark_startup("benchmarks")  # its own phase of the start-up, not the first step's
    elif scores := benchmarks.resume(start):  # the resumed step's scoring, where no file of the run kept it
        run.logger.log(scores, start)
    with run.progress(start) as progress:
        for step in range(start + 1, stop + 1):
            with clock.host():
                run.beat(step, "data")
                batches = [sequence_shard(b, run.sequence_rank, run.dims.sequence) for b in rank_micro_batches(
                    data.train, step - 1, run.plan.global_batch_size, run.plan.micro_batch_size, run.data_rank,
                    run.dims.data)]
            result = run_step(run, batches, step, clock, reference)
            run.guard.observe(f"step {step}", result.skipped)
            metrics = meter.maybe_measure(step, result, run.guard.skipped) | evaluator.maybe_evaluate(step)
            run.logger.log(metrics, step)  # before the save: a step its checkpoint holds has its metrics logged
            progress.advance(metrics)
            run.checkpointer.maybe_save(step, lambda: position(run, step) | (
                {"benchmarks": benchmarks.scores} if benchmarks.scores else {}))
            if scores := benchmarks.maybe_score(step):  # after the save: a scoring never costs the checkpoint
                run.logger.log(scores, step)
            summary |= metrics | scores
    if benchmarks.scores:  # lm_eval's, each scoring of the run
        summary["benchmarks"] = benchmarks.scores
    return summary


def run_step(run: Run, batches: list, step: int, clock: ComputeClock, reference: PairReference | None):
    """Step `step` on this rank's micro-batches: train_step, or preference_step on pairs."""
    kw = {"poison": step in run.cfg.train.debug_nonfinite_steps, "beat": functools.partial(run.beat, step),
          "clock": clock, "group": run.token_group, "data_parallel": run.dims.gradient_ranks(run.zero_stage)}
    if reference is not None:
        return preference_step(run.engine, batches, reference.train, run.cfg.dpo, **kw)
    fault = loss_fault(run.cfg.train.debug_loss_fault, run.zero_stage)
    if fault == "sequence_divisor":  # the other stage's rule (ParallelDims.gradient_ranks)
        kw["data_parallel"] = run.dims.data * (run.dims.sequence if run.zero_stage != 3 else 1)
    fast = run.speedups
    return train_step(run.engine, batches, tile_tokens=fast.loss_tile_tokens, fused_loss=fast.fused_loss,
                      head_factor=fast.head_factor, fault=fault, **kw)


def position(run: Run, step: int) -> dict:
    """Where the data stream stands after `step` (the checkpoint's part of the loop state)."""
    return {"samples": step * run.plan.global_batch_size, "tokens": step * run.plan.tokens_per_step}


@dataclass
class StepResult:
    loss_sum: Any  # summed token loss on this rank: a tensor, not synced
    tokens: int
    grad_norm: float | None  # only where DeepSpeed does not report it
    skipped: bool  # gradients not finite: the update was not applied (same answer on every rank)
    aux_sum: float = 0.0  # the router's auxiliary loss summed over this rank's micro-batches (an MoE model's)
    aux_count: int = 0  # micro-batches that had one


def train_step(engine, micro_batches: list[np.ndarray] | list[Batch], poison: bool = False,
               beat: Callable[[str], None] = lambda phase: None, clock: ComputeClock | None = None,
               group=None, data_parallel: int | None = None, tile_tokens: int = 0, fused_loss: bool = False,
               head_factor: float = 1.0, fault: str = "") -> StepResult:
    """One optimizer step: the engine owns accumulation scaling, clipping and the optimizer.

    The gradient is that of the mean loss over the step's target tokens on every rank. Windows all
    hold the same number; sft micro-batches do not, so each one's summed loss is divided by the
    step's total over all ranks (`group`: the ranks whose tokens make up the batch; one all-reduce
    of a count), times the engine's own averaging over micro-batches and ranks, which backward undoes.

    `data_parallel`: how many ranks DeepSpeed divides the summed gradient by (ParallelDims.gradient_ranks;
    default the engine's data-parallel size); `tile_tokens`, `fused_loss`, `head_factor`: the loss's tiles as the
    start-up probe kept them (Run.speedups).
    `poison` makes the loss infinite (fault injection for train.debug_nonfinite_steps); `fault`: a
    train.debug_loss_fault kind (ds_train/faults.py); `beat` tells the heartbeat each phase; `clock`
    times the forward passes (this rank's own work).
    """
    loss_total, tokens_total, grad_norm = 0.0, 0, None
    skipped_before = engine.skipped_steps
    clock = clock or ComputeClock(False)
    per_step = None
    if micro_batches and isinstance(micro_batches[0], Batch):
        mine = sum(b.n_targets for b in micro_batches)
        step_targets, ranks = dist.all_reduce_sum([mine, 1], group)
        if fault == "mean_of_rank_means":
            step_targets = mine * ranks
        # DeepSpeed sums gradients over the sequence ranks and averages over the data-parallel ones
        ranks_dividing = data_parallel or engine.dp_world_size
        per_step = max(step_targets, 1) / (ranks_dividing * engine.gradient_accumulation_steps())
    dropped = len(micro_batches) - 1 if fault == "drop_micro_batch" and engine.global_rank == 0 else None
    aux_coef, aux_total, aux_count = router_aux_loss_coef(engine), 0.0, 0
    if fault == "aux_loss_summed":
        aux_coef *= engine.gradient_accumulation_steps()
    for i, batch in enumerate(micro_batches):
        beat("forward")
        with clock.device():
            loss_sum, n_tokens, aux = forward_losses(engine, batch, tile_tokens, fused_loss, head_factor)
        if poison:
            loss_sum = loss_sum * float("inf")
        divisor = per_step or n_tokens
        if i == dropped:
            loss_sum, n_tokens = loss_sum * 0.0, 0
        loss = loss_sum / divisor
        if aux is not None:  # per micro-batch, as Hugging Face adds it; the engine averages it over all of them
            loss = loss + aux_coef * aux
            aux_total, aux_count = aux_total + aux.detach(), aux_count + 1
        norm = backward_step(engine, loss, beat)
        grad_norm = norm if norm is not None else grad_norm
        loss_total = loss_total + loss_sum.detach()
        tokens_total += n_tokens
    return StepResult(loss_total, tokens_total, grad_norm, engine.skipped_steps > skipped_before, aux_total, aux_count)


def router_aux_loss_coef(engine) -> float:
    """The weight of a mixture-of-experts model's router loss in the training loss (its config's
    router_aux_loss_coef, as Hugging Face's forward adds it when given labels)."""
    config = getattr(getattr(engine, "module", engine), "config", None)
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def generate_sample(run: Run) -> str:
    """Continue log.sample_prompt greedily with the trained model (all ranks take part under ZeRO-3)."""
    import torch

    prompt = run.cfg.log.sample_prompt
    run.beat(run.cfg.train.max_steps, "sample")
    ids = run.tokenizer(prompt, return_tensors="pt").input_ids.to(run.engine.device)
    run.engine.eval()
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):  # compiled layers: not for each cache length
        out = run.engine.module.generate(
            ids, max_new_tokens=run.cfg.log.sample_tokens, min_new_tokens=run.cfg.log.sample_tokens,
            do_sample=False, repetition_penalty=run.cfg.log.sample_repetition_penalty, use_cache=True,
            pad_token_id=run.tokenizer.eos_token_id, synced_gpus=run.collective_forward)
    run.engine.train()
    return run.tokenizer.decode(out[0], skip_special_tokens=True)


def maybe_export_final(run: Run) -> str:
    """Rank 0 writes the HF directory from the final checkpoint (all ranks wait for the save)."""
    from ds_train.checkpoint.commit import tag_for
    from ds_train.checkpoint.export import export

    run.beat(run.cfg.train.max_steps, "export")  # untimed: the other ranks wait for rank 0
    dist.barrier()
    tag = tag_for(run.cfg.train.max_steps)
    out = run.paths.hf_export(tag)
    if run.env.is_main and not out.exists():
        export(run.run_dir, out, tag)
        run.say(f"exported {out}")
    dist.barrier()
    return str(out)


def finish(run: Run, metrics: dict) -> dict:
    results = {"steps": run.cfg.train.max_steps,
               "tokens": run.cfg.train.max_steps * run.plan.tokens_per_step,
               "final_train_loss": metrics.get("train/loss"), "final_eval_loss": metrics.get("eval/loss"),
               "tokens_per_s": metrics.get("perf/tokens_per_s"), "world_size": run.env.world_size,
               "parallel": run.dims.record(), "startup_s": run.startup_s(),
               "run_dir": str(run.run_dir.resolve())}
    # (generation under Ulysses would split a prompt of a few tokens: no sample with parallel.sequence)
    sample = (generate_sample(run) if run.cfg.log.sample_prompt and run.cfg.log.sample_tokens
              and run.dims.sequence == 1 else None)
    if run.cfg.checkpoint.export_final:
        results["export"] = maybe_export_final(run)
    if run.env.is_main:
        results["sample"] = sample
        if metrics.get("benchmarks"):
            results["benchmarks"] = metrics["benchmarks"]
        write_atomic(run.paths.results(TRAIN), json.dumps(results, indent=2))
        if sample is not None:
            print(f"\n--- sample ---\n{sample}\n--------------")
    run.write_plots()
    losses = [f"{name} {value:.4g}" for name, value in (("final loss", results["final_train_loss"]),
                                                        ("eval loss", results["final_eval_loss"])) if value is not None]
    run.say_outcome(", ".join([f"done, {results['steps']} steps", *losses]))
    return results
