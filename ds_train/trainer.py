"""Training: `deepspeed --num_gpus 2 --module ds_train train --config C --ds-config D`.

`train` prepares the data and the model source, builds the run (ds_train/run.py), and runs
`train_loop`: next batch, step, and whatever each component says is due (the non-finite guard,
the metrics meter, the evaluator, the logger, the checkpointer).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ds_train import dist
from ds_train.config import DataConfig, RunConfig, TrainConfig
from ds_train.data import (IGNORE, Batch, SftData, TokenData, check_vocab, ensure_prepared, eval_micro_batches,
                           rank_micro_batches)
from ds_train.engine import read_ds_template
from ds_train.errors import NonFiniteStop, UserError
from ds_train.export import locate_model
from ds_train.fs import write_atomic
from ds_train.metrics import Interval, memory_gib, mfu
from ds_train.model import build_hf_config, supports_packing
from ds_train.reports import stragglers
from ds_train.run import ModelSource, Run, RunSpec, build_run, resolve_model

def train_spec(cfg: RunConfig) -> RunSpec:
    return RunSpec("train", last=cfg.train.max_steps, steps=lambda plan: cfg.train.max_steps)


def prepare_data(d: DataConfig, tokenizer: str = "") -> dict:
    """data.dir's meta.json, tokenising data.sources into it on first use (once, under a lock), and
    again when they changed and data.reprepare is set."""
    return ensure_prepared(d, tokenizer)


@dataclass(frozen=True)
class Datasets:
    train: TokenData | SftData
    val: TokenData | SftData
    summary: str = ""  # how sft examples became sequences (said at the start of a run)

    def identity(self) -> dict:
        """What identifies the sample stream, recorded in every checkpoint (a resume checks it)."""
        out = {"train_tokens": len(self.train.tokens), "val_tokens": len(self.val.tokens)}
        if isinstance(self.train, SftData):
            out |= {"format": "sft", "train_samples": self.train.num_samples, "packed": self.train.pack}
        elif self.train.mix is not None:
            out["mixture_slots"] = self.train.mix[2].tolist()
        return out


def build_inputs(cfg: RunConfig) -> tuple[Datasets, ModelSource]:
    """The data (prepared on first use) and the model it fits; every check, nothing in the run dir.
    The model's own checks come first: preparing a corpus takes a while, a bad key does not."""
    d = cfg.data
    if cfg.model.config:  # the architecture, at a stand-in vocabulary size until the data's is known
        build_hf_config(cfg.model, int(cfg.model.config.get("vocab_size") or d.vocab_size), cfg.train.seq_len)
    model_dir = locate_model(cfg.model.path)[0] if cfg.model.path else ""
    tokenizer_dir = d.tokenizer or str(model_dir)
    meta = prepare_data(d, tokenizer_dir)
    source = resolve_model(cfg, tokenizer_dir or meta["tokenizer"])
    check_vocab(meta, getattr(source.hf_config, "vocab_size", None), d.dir)
    if meta.get("format", "text") != d.format:
        raise UserError(f"data.dir {d.dir!r} holds {meta.get('format', 'text')} data and data.format is "
                        f"{d.format}; prepare it again (data.reprepare=true) or set data.format")
    if d.format == "sft":
        return sft_datasets(cfg, meta, source), source
    ranges = meta.get("source_ranges") if d.weights else None
    if d.weights and (not isinstance(ranges, list) or len(ranges) != len(d.weights)):
        raise UserError(f"data.weights: data.dir {d.dir!r} does not record where each of the "
                        f"{len(d.weights)} sources lies (prepared by an older ds_train, or from other "
                        f"sources); prepare it again with data.reprepare=true")
    data = Datasets(*(TokenData(Path(d.dir) / f"{split}.bin", meta["dtype"], cfg.train.seq_len, cfg.seed,
                                ranges if split == "train" else None, d.weights if split == "train" else None,
                                d.sources) for split in ("train", "val")))
    return data, source


def sft_datasets(cfg: RunConfig, meta: dict, source: ModelSource) -> Datasets:
    """Instruction data: packed where the model's attention keeps packed examples apart."""
    d = cfg.data
    can_pack = supports_packing(source.hf_config)
    if d.pack is True and not can_pack:
        raise UserError(f"data.pack: {type(source.hf_config).__name__} does not separate packed examples "
                        f"(its attention mask ignores position_ids); set data.pack=auto or false")
    pack = can_pack if d.pack == "auto" else bool(d.pack)
    pad = meta.get("eos_token_id") or 0
    train, val = (SftData(Path(d.dir), split, meta["dtype"], cfg.train.seq_len, cfg.seed, pack, d.overlong,
                          pad, shuffle_pack=split == "train") for split in ("train", "val"))
    why = "" if pack or d.pack is False else " (the model's attention cannot keep packed examples apart)"
    return Datasets(train, val, f"sft, {train.summary()}{why}")


def train(cfg: RunConfig, ds_config_path: str) -> dict:
    read_ds_template(ds_config_path)  # before the data is prepared (build_run reads it again)
    data, source = build_inputs(cfg)
    with build_run(cfg, ds_config_path, dist.detect_env(), train_spec(cfg), source, data=data.identity()) as run:
        run.say(f"data: {len(data.train.tokens):,} train tokens in {cfg.data.dir}")
        if data.summary:
            run.say(f"data: {data.summary}")
        start = int((run.maybe_resume() or {}).get("step", 0))
        if start >= cfg.train.max_steps:  # its results stay as they were
            run.say(f"already trained to step {start} >= train.max_steps={cfg.train.max_steps}; nothing "
                    f"to do; raise train.max_steps to continue, or set another output_dir")
            results = run.run_dir / "results.json"
            try:
                json.loads(results.read_text())
            except (OSError, ValueError):
                run.say(f"note: {results} is missing or damaged; the trained weights are whole in the checkpoint "
                        f"of step {start}: `ds-train export {run.run_dir} --out DIR` writes a model directory")
            return {"steps": start, "run_dir": str(run.run_dir.resolve())}
        metrics = train_loop(run, data, start, cfg.train.max_steps)
        return finish(run, metrics)


def train_loop(run: Run, data: Datasets, start: int, stop: int) -> dict[str, Any]:
    """Steps start+1 .. stop: next batch, step, then each component acts if the step is its."""
    c, last = run.cfg, run.cfg.train.max_steps
    guard = NonFiniteGuard(c.train, run.rank_log)
    clock = ComputeClock(run.engine.device.type == "cuda")
    meter = StepMeter(run, Interval(c.log.every, last), clock)
    evaluator = Evaluator(run, data.val, Interval(c.train.eval_every, last))
    summary: dict[str, Any] = {}
    with run.progress(start) as progress:
        for step in range(start + 1, stop + 1):
            with clock.host():
                run.beat(step, "data")
                batches = rank_micro_batches(data.train, step - 1, run.plan.global_batch_size,
                                             run.plan.micro_batch_size, run.env.rank, run.env.world_size)
            result = train_step(run.engine, batches, poison=step in c.train.debug_nonfinite_steps,
                                beat=functools.partial(run.beat, step), clock=clock)
            guard.observe(step, result.skipped)
            metrics = meter.maybe_measure(step, result, guard.skipped) | evaluator.maybe_evaluate(step)
            run.logger.log(metrics, step)
            progress.advance(metrics)
            run.checkpointer.maybe_save(step, lambda: position(run, step))
            summary |= metrics
    return summary


def position(run: Run, step: int) -> dict:
    """Where the data stream stands after `step` (the checkpoint's part of the loop state)."""
    return {"samples": step * run.plan.global_batch_size, "tokens": step * run.plan.tokens_per_step}


def token_mean(loss_sum: float, tokens: int) -> float:
    """The mean loss per token over every rank: summed losses over summed counts (one all-reduce),
    never a mean of per-rank means, which would weigh a rank's tokens by how few it had."""
    loss, count = dist.all_reduce_sum([loss_sum, tokens])
    return loss / count


def forward_loss(engine, batch: np.ndarray | Batch):
    """Summed next-token cross-entropy and the count of target tokens of one micro-batch: windows
    of seq_len + 1 tokens (pretraining), or a Batch (sft: targets on the assistant's tokens, and
    position ids restarting at each packed example, which keep examples from attending across)."""
    import torch
    import torch.nn.functional as F

    if isinstance(batch, Batch):
        inputs, targets = torch.from_numpy(batch.inputs), torch.from_numpy(batch.targets)
        extra = {} if batch.positions is None else {"position_ids": torch.from_numpy(batch.positions).to(engine.device)}
        count = batch.n_targets
    else:
        tokens = torch.from_numpy(batch)
        inputs, targets, extra = tokens[:, :-1], tokens[:, 1:], {}
        count = targets.numel()
    logits = engine(input_ids=inputs.to(engine.device), use_cache=False, **extra).logits
    loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.to(engine.device).reshape(-1),
                               reduction="sum", ignore_index=IGNORE)
    return loss_sum, count


def _engine_checks_grads(engine) -> bool:
    """DeepSpeed computes the global grad norm and skips non-finite steps itself in every engine
    except plain fp32 ZeRO-0 (a torch optimizer: it clips, then drops the norm)."""
    return bool(engine.zero_optimization() or engine.bfloat16_enabled() or engine.fp16_enabled())


def _grad_norm(engine) -> float:
    import torch

    norms = [p.grad.detach().float().norm() for p in engine.module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


@dataclass
class StepResult:
    loss_sum: Any  # summed token loss on this rank: a tensor, not synced
    tokens: int
    grad_norm: float | None  # only where DeepSpeed does not report it
    skipped: bool  # gradients not finite: the update was not applied (same answer on every rank)


@contextlib.contextmanager
def _skipped_optimizer_step(optimizer):
    """Skip one step of a torch optimizer the way DeepSpeed's own optimizers skip an overflow:
    `optimizer.overflow` makes the engine count the step as skipped and hold the LR schedule."""
    optimizer.step = lambda *args, **kwargs: None  # shadows the class method for this one call
    optimizer.overflow = True
    try:
        yield
    finally:
        del optimizer.step
        optimizer.overflow = False


def train_step(engine, micro_batches: list[np.ndarray] | list[Batch], poison: bool = False,
               beat: Callable[[str], None] = lambda phase: None, clock: "ComputeClock | None" = None) -> StepResult:
    """One optimizer step: the engine owns accumulation scaling, clipping and the optimizer.

    The gradient is that of the mean loss over the step's target tokens on every rank. Windows all
    hold the same number; sft micro-batches do not, so each one's summed loss is divided by the
    step's total over all ranks (one all-reduce of a count), times the engine's own averaging over
    micro-batches and ranks, which backward undoes.

    `poison` makes the loss infinite (fault injection for train.debug_nonfinite_steps); `beat`
    tells the heartbeat each phase; `clock` times the forward passes (this rank's own work).
    """
    loss_total, tokens_total, grad_norm = 0.0, 0, None
    skipped_before = engine.skipped_steps
    clock = clock or ComputeClock(False)
    per_step = None
    if micro_batches and isinstance(micro_batches[0], Batch):
        step_targets = dist.all_reduce_sum([sum(b.n_targets for b in micro_batches)])[0]
        per_step = max(step_targets, 1) / (engine.dp_world_size * engine.gradient_accumulation_steps())
    for batch in micro_batches:
        beat("forward")
        with clock.device():
            loss_sum, n_tokens = forward_loss(engine, batch)
        if poison:
            loss_sum = loss_sum * float("inf")
        beat("backward")
        engine.backward(loss_sum / (per_step or n_tokens))
        skip = contextlib.nullcontext()
        if engine.is_gradient_accumulation_boundary() and not _engine_checks_grads(engine):
            grad_norm = _grad_norm(engine)  # after the all-reduce in backward: the same on every rank
            if not math.isfinite(grad_norm):
                skip = _skipped_optimizer_step(engine.optimizer)
        beat("step")
        with skip:
            engine.step()
        loss_total = loss_total + loss_sum.detach()
        tokens_total += n_tokens
    return StepResult(loss_total, tokens_total, grad_norm, engine.skipped_steps > skipped_before)


class NonFiniteGuard:
    """Counts steps whose gradients were not finite (never applied); train.nonfinite=stop ends the
    run after train.nonfinite_patience in a row (every rank decides the same)."""

    def __init__(self, c: TrainConfig, rank_log):
        self.stop_after = c.nonfinite_patience if c.nonfinite == "stop" else 0
        self.rank_log = rank_log
        self.skipped = self.in_a_row = 0

    def observe(self, step: int, skipped: bool) -> None:
        self.skipped += skipped
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if skipped:
            self.rank_log.info(f"step {step}: gradients not finite, update skipped")
        if self.stop_after and self.in_a_row >= self.stop_after:
            raise NonFiniteStop(step, self.in_a_row)


class ComputeClock:
    """The time a rank spends on its own work before a step's gradients are synchronised: loading
    its data (host time) and its forward passes (CUDA events on a GPU, whose kernels run after the
    host moves on). Compared across ranks on logging steps, it finds the straggler that everyone
    else waits for: a slow GPU, a slow disk, a busy host."""

    def __init__(self, cuda: bool):
        self.cuda, self.seconds, self.events = cuda, 0.0, []

    @contextlib.contextmanager
    def host(self):
        t0 = time.perf_counter()
        yield
        self.seconds += time.perf_counter() - t0

    @contextlib.contextmanager
    def device(self):
        if not self.cuda:
            with self.host():
                yield
            return
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.events.append((start, end))

    def read(self) -> float:
        """Seconds since the last read (waits for the timed kernels to finish)."""
        for start, end in self.events:
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1000
        total, self.seconds, self.events = self.seconds, 0.0, []
        return total


class StepMeter:
    """On logging steps: the step's loss (token-weighted over all ranks), throughput over the steps
    since the last logging step, memory maxima over ranks, and the slowest rank (one small gather
    of every rank's compute time per step; a rank above watchdog.straggler_ratio x the median is
    reported). Empty on other steps."""

    def __init__(self, run: Run, interval: Interval, clock: ComputeClock):
        self.run, self.interval, self.clock = run, interval, clock
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.warm = False  # the first window holds one-time costs (allocations, kernel choice)

    def maybe_measure(self, step: int, result: StepResult, skipped_steps: int) -> dict:
        self.window_steps += 1
        if step not in self.interval:
            return {}
        run = self.run
        run.beat(step, "metrics")
        window_s = time.perf_counter() - self.window_start
        loss = token_mean(float(result.loss_sum), result.tokens)
        tokens_per_s = run.plan.tokens_per_step * self.window_steps / window_s
        grad_norm = result.grad_norm if result.grad_norm is not None else run.engine.get_global_grad_norm()
        metrics = {
            "train/loss": loss,
            "train/tokens": run.plan.tokens_per_step * step,
            "train/skipped_steps": skipped_steps,
            "optim/lr": float(run.engine.get_lr()[0]),
            "optim/grad_norm": float(grad_norm) if grad_norm is not None and math.isfinite(grad_norm) else None,
            "perf/tokens_per_s": tokens_per_s,
            "perf/step_time_s": window_s / self.window_steps,
            "perf/mfu": mfu(tokens_per_s / run.env.world_size, run.flops_per_token, run.peak_flops),
            "world_size": run.env.world_size,
            **self.per_rank(step),
        }
        self.window_start, self.window_steps = time.perf_counter(), 0
        return metrics

    def per_rank(self, step: int) -> dict:
        """Every rank's compute time per step and memory (one small gather): the slowest rank, a
        straggler report, memory per rank and its maximum."""
        run = self.run
        gpu_gib, rss_gib = memory_gib(run.engine.device.type)
        ranks = dist.all_gather_floats([self.clock.read() / self.window_steps, gpu_gib, rss_gib])
        times, gpu, rss = ([r[i] for r in ranks] for i in range(3))
        slowest, ratio, median, slow = stragglers(times, run.cfg.watchdog.straggler_ratio)
        if slow and self.warm:
            line = f"step {step}: straggler: " + "; ".join(
                f"{run.where(r)} takes {times[r] / median:.2f}x the median compute time per step of the other "
                f"ranks ({times[r]:.3f} s vs {median:.3f} s)" for r in slow)
            run.say(line)
            run.rank_log.warning(line)
        self.warm = True
        return {"perf/slowest_rank": slowest, "perf/straggler_ratio": ratio, "mem/max_rank_gib": max(gpu),
                "mem/max_rank_rss_gib": max(rss), "mem/rank_gpu_gib": gpu, "mem/rank_rss_gib": rss}


class Evaluator:
    """Token-weighted validation loss over a fixed set of val.bin, exact across ranks."""

    def __init__(self, run: Run, val: TokenData, interval: Interval):
        self.run, self.val, self.interval = run, val, interval

    def maybe_evaluate(self, step: int) -> dict[str, float]:
        return self.evaluate(step) if step in self.interval else {}

    def evaluate(self, step: int) -> dict[str, float]:
        import torch

        run, engine = self.run, self.run.engine
        engine.eval()
        loss, count = 0.0, 0
        with torch.no_grad():
            for batch in eval_micro_batches(self.val, run.cfg.train.eval_batches, run.plan.micro_batch_size,
                                            run.env.rank, run.env.world_size):
                run.beat(step, "eval")
                loss_sum, n = forward_loss(engine, batch)
                loss, count = loss + float(loss_sum), count + n
        engine.train()
        mean = token_mean(loss, count)
        return {"eval/loss": mean, "eval/ppl": math.exp(min(mean, 50.0))}


def generate_sample(run: Run) -> str:
    """Continue log.sample_prompt with the trained model (all ranks take part under ZeRO-3)."""
    import torch

    prompt = run.cfg.log.sample_prompt
    run.beat(run.cfg.train.max_steps, "sample")
    ids = run.tokenizer(prompt, return_tensors="pt").input_ids.to(run.engine.device)
    run.engine.eval()
    torch.manual_seed(run.cfg.seed)
    with torch.no_grad():
        out = run.engine.module.generate(
            ids, max_new_tokens=run.cfg.log.sample_tokens, min_new_tokens=run.cfg.log.sample_tokens,
            do_sample=True, top_k=40, temperature=0.8, use_cache=True,
            pad_token_id=run.tokenizer.eos_token_id, synced_gpus=run.zero_stage == 3)
    run.engine.train()
    return run.tokenizer.decode(out[0], skip_special_tokens=True)


def maybe_export_final(run: Run) -> str:
    """Rank 0 writes the HF directory from the final checkpoint (all ranks wait for the save)."""
    from ds_train.checkpoint import tag_for
    from ds_train.export import export

    run.beat(run.cfg.train.max_steps, "export")  # untimed: the other ranks wait for rank 0
    dist.barrier()
    tag = tag_for(run.cfg.train.max_steps)
    out = run.run_dir / f"hf_export_{tag}"
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
               "run_dir": str(run.run_dir.resolve())}
    sample = generate_sample(run) if run.cfg.log.sample_prompt and run.cfg.log.sample_tokens else None
    if run.cfg.checkpoint.export_final:
        results["export"] = maybe_export_final(run)
    if run.env.is_main:
        results["sample"] = sample
        write_atomic(run.run_dir / "results.json", json.dumps(results, indent=2))
        if sample is not None:
            print(f"\n--- sample ---\n{sample}\n--------------")
    run.write_plots()
    if run.env.is_main:
        print(f"run directory: {results['run_dir']}")
    return results
