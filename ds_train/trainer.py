"""The training loop: `deepspeed --num_gpus 2 --module ds_train train --config C --ds-config D`.

`build_run` does all the setting up (batch math, data, model, engine, sinks); `train` is the loop:
next batch, step, maybe log, maybe eval, maybe save.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import random
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ds_train import checkpoint, dist
from ds_train.batch import BatchPlan, plan_batch, scaled_lr
from ds_train.config import RunConfig, save_config
from ds_train.data import TokenData, ensure_prepared, eval_micro_batches, load_tokenizer, rank_micro_batches
from ds_train.engine import initialize, read_ds_template, render_ds_config, zero_stage
from ds_train.errors import UserError
from ds_train.metrics import (Logger, build_logger, rewind_jsonl, build_progress, build_rank_log, memory_gib, mfu,
                              peak_flops)
from ds_train.model import build_hf_config, build_model, count_params, flops_per_token, resolve_dtype


@dataclass
class Run:
    cfg: RunConfig
    env: dist.DistEnv
    plan: BatchPlan
    run_dir: Path
    engine: Any
    tokenizer: Any
    train_data: TokenData
    val_data: TokenData
    ds_config: dict
    flops_per_token: float
    peak_flops: float | None
    logger: Logger
    rank_log: Any
    say: Any  # print on rank 0, nothing elsewhere
    dtype: str
    resume: checkpoint.ResumePoint | None = None


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _say(is_main: bool):
    return print if is_main else (lambda *a, **k: None)


def _check_vocab(meta: dict, hf_config, data_dir: str) -> None:
    vocab = getattr(hf_config, "vocab_size", None)
    if vocab is not None and meta.get("max_token_id", 0) >= vocab:
        raise UserError(f"data.dir {data_dir!r}: token id {meta['max_token_id']} >= the model's "
                        f"vocab_size {vocab}; prepare the data with the model's tokenizer or raise "
                        f"model.config.vocab_size")


def build_run(cfg: RunConfig, ds_config_path: str, env: dist.DistEnv, quiet: bool = False) -> Run:
    """Everything before the first step. User errors surface here, before anything is written."""
    import torch
    from deepspeed.accelerator import get_accelerator

    template = read_ds_template(ds_config_path)
    plan = plan_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size, env.world_size,
                      cfg.train.seq_len)
    accel = get_accelerator()
    on_gpu = accel.device_name() == "cuda"
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    d = cfg.data
    tok_dir = d.tokenizer or (cfg.model.path if cfg.model.path else "")
    meta = ensure_prepared(d.dir, d.sources, tok_dir, d.vocab_size, d.val_fraction, d.text_key)
    tokenizer = load_tokenizer(meta["tokenizer"] if not tok_dir else tok_dir)
    hf_config = build_hf_config(cfg.model, len(tokenizer), cfg.train.seq_len)
    _check_vocab(meta, hf_config, d.dir)
    dtype = resolve_dtype(cfg.model.dtype, accel.device_name(), accel.is_bf16_supported())
    lr = scaled_lr(cfg.optim.lr, plan.global_batch_size, cfg.optim.reference_batch_size,
                   cfg.optim.lr_scaling)
    ds_config = render_ds_config(template, cfg, plan, dtype, hf_config.hidden_size, lr, on_gpu,
                                 source=str(ds_config_path))
    run_dir = Path(cfg.output_dir)
    resume = checkpoint.find_resume(cfg.checkpoint.resume, run_dir / "checkpoints")
    changes = check_resume(resume, cfg)
    resume, notes, universal = checkpoint.plan_resume(resume, env.world_size, zero_stage(ds_config), dtype,
                                                      cfg.checkpoint.load_universal)
    if universal:
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    train_data = TokenData(Path(d.dir) / "train.bin", meta["dtype"], cfg.train.seq_len, cfg.seed)
    val_data = TokenData(Path(d.dir) / "val.bin", meta["dtype"], cfg.train.seq_len, cfg.seed)

    dist.init(env)  # after every check that needs no peers, so bad input fails fast on each rank
    seed_everything(cfg.seed)
    built = build_model(cfg.model, hf_config, ds_config, cfg.seed)
    n_params = count_params(built.model)
    engine = initialize(built.model, ds_config)

    run_dir.mkdir(parents=True, exist_ok=True)
    say = _say(env.is_main and not quiet)
    if changes:
        say("resuming with changed settings: " + "; ".join(changes))
    for note in notes:
        say(note)
    # (node rank, hostname) per rank: loopback "nodes" on one machine share a hostname.
    hosts = dist.all_gather_object((env.node_rank, socket.gethostname()))
    if env.is_main:
        save_config(cfg, run_dir / "config.yaml")
        (run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2))
        (run_dir / "env.json").write_text(json.dumps(_env_record(env, hosts, dtype), indent=2))
        save_hf_metadata(hf_config, tokenizer, run_dir / "hf_model")
    say(plan.describe())
    say(f"lr {lr:.3g} (optim.lr {cfg.optim.lr:g}, scaling {cfg.optim.lr_scaling}); dtype {dtype}; "
        f"ZeRO stage {zero_stage(ds_config)}; {n_params / 1e6:.2f}M parameters; "
        f"{meta['train_tokens']:,} train tokens")
    say(_host_table(hosts))
    fpt = flops_per_token(n_params, hf_config.num_hidden_layers, hf_config.hidden_size, cfg.train.seq_len)
    device_name = torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu"
    if resume and env.is_main:  # steps after the checkpoint are trained again: drop their old lines
        rewind_jsonl(run_dir / "metrics.jsonl", int(resume.state["step"]))
    logger = build_logger(env.is_main, run_dir, cfg.log.wandb, cfg.log.wandb_project, cfg.to_dict())
    rank_log = build_rank_log(run_dir, env.rank)
    rank_log.info(f"pid {os.getpid()} host {socket.gethostname()} local_rank {env.local_rank} node {env.node_rank} "
                  f"world {env.world_size} launcher {env.launcher} device {device_name}")
    return Run(cfg, env, plan, run_dir, engine, tokenizer, train_data, val_data, ds_config, fpt,
               peak_flops(device_name, cfg.log.peak_tflops) if on_gpu else None, logger, rank_log, say,
               dtype, resume)


def check_resume(point: checkpoint.ResumePoint | None, cfg: RunConfig) -> list[str]:
    """Refuse a resume that would change the model or the data stream; list allowed changes."""
    if point is None:
        return []
    where = point.load_dir / point.tag
    errors, notes = checkpoint.config_changes(point.state["config"], cfg.to_dict())
    if errors:
        raise UserError(f"{where}: cannot resume with a changed " + "; ".join(errors) +
                        " (these fix the model or the data order; use another output_dir or "
                        "checkpoint.resume=none)")
    return notes


def save_hf_metadata(hf_config, tokenizer, out: Path) -> None:
    """config.json, generation_config.json and the tokenizer: what `ds-train export` adds weights to."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(out)
    GenerationConfig.from_model_config(hf_config).save_pretrained(out)
    tokenizer.save_pretrained(out)


def _env_record(env: dist.DistEnv, hosts: list[tuple[int, str]], dtype: str) -> dict:
    import deepspeed
    import torch
    import transformers

    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "world_size": env.world_size, "launcher": env.launcher, "hosts": _nodes(hosts),
            "accelerator": dist.accelerator_name(), "dtype": dtype}


def _nodes(hosts: list[tuple[int, str]]) -> list[dict]:
    """[{node, host, ranks}] in node order, from each rank's (node rank, hostname)."""
    by_node: dict[tuple[int, str], list[int]] = {}
    for rank, (node, host) in enumerate(hosts):
        by_node.setdefault((node, host), []).append(rank)
    return [{"node": node, "host": host, "ranks": ranks} for (node, host), ranks in sorted(by_node.items())]


def _host_table(hosts: list[tuple[int, str]]) -> str:
    """`hosts: node0 vm -> ranks 0,1; node1 vm -> ranks 2,3`."""
    return "hosts: " + "; ".join(f"node{n['node']} {n['host']} -> ranks {','.join(map(str, n['ranks']))}"
                                 for n in _nodes(hosts))


def forward_loss(engine, batch: np.ndarray):
    """Summed next-token cross-entropy and the token count of one micro-batch."""
    import torch
    import torch.nn.functional as F

    tokens = torch.from_numpy(batch).to(engine.device)
    logits = engine(input_ids=tokens[:, :-1], use_cache=False).logits
    targets = tokens[:, 1:]
    loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                               reduction="sum")
    return loss_sum, targets.numel()


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


def train_step(engine, micro_batches: list[np.ndarray], poison: bool = False) -> StepResult:
    """One optimizer step: the engine owns accumulation scaling, clipping and the optimizer.

    `poison` makes the loss infinite (fault injection for train.debug_nonfinite_steps).
    """
    loss_total, tokens_total, grad_norm = 0.0, 0, None
    skipped_before = engine.skipped_steps
    for batch in micro_batches:
        loss_sum, n_tokens = forward_loss(engine, batch)
        if poison:
            loss_sum = loss_sum * float("inf")
        engine.backward(loss_sum / n_tokens)
        skip = contextlib.nullcontext()
        if engine.is_gradient_accumulation_boundary() and not _engine_checks_grads(engine):
            grad_norm = _grad_norm(engine)  # after the all-reduce in backward: the same on every rank
            if not math.isfinite(grad_norm):
                skip = _skipped_optimizer_step(engine.optimizer)
        with skip:
            engine.step()
        loss_total = loss_total + loss_sum.detach()
        tokens_total += n_tokens
    return StepResult(loss_total, tokens_total, grad_norm, engine.skipped_steps > skipped_before)


def evaluate(run: Run) -> dict[str, float]:
    """Token-weighted validation loss over a fixed set, exact across ranks."""
    import torch

    engine = run.engine
    engine.eval()
    loss, count = 0.0, 0
    with torch.no_grad():
        for batch in eval_micro_batches(run.val_data, run.cfg.train.eval_batches,
                                        run.plan.micro_batch_size, run.env.rank, run.env.world_size):
            loss_sum, n = forward_loss(engine, batch)
            loss, count = loss + float(loss_sum), count + n
    engine.train()
    loss, count = dist.all_reduce_sum([loss, count])
    mean = loss / count
    return {"eval/loss": mean, "eval/ppl": math.exp(min(mean, 50.0))}


def step_metrics(run: Run, step: int, result: StepResult, skipped_steps: int, window_s: float,
                 window_steps: int) -> dict:
    """Reduce the step's loss (token-weighted) and the memory figures over all ranks."""
    gpu_gib, rss_gib = memory_gib(run.engine.device.type)
    loss, count = dist.all_reduce_sum([float(result.loss_sum), result.tokens])
    max_gpu, max_rss = dist.all_reduce_max([gpu_gib, rss_gib])
    tokens_per_s = run.plan.tokens_per_step * window_steps / window_s
    grad_norm = result.grad_norm if result.grad_norm is not None else run.engine.get_global_grad_norm()
    return {
        "train/loss": loss / count,
        "train/tokens": run.plan.tokens_per_step * step,
        "train/skipped_steps": skipped_steps,
        "optim/lr": float(run.engine.get_lr()[0]),
        "optim/grad_norm": float(grad_norm) if grad_norm is not None and math.isfinite(grad_norm) else None,
        "perf/tokens_per_s": tokens_per_s,
        "perf/step_time_s": window_s / window_steps,
        "perf/mfu": mfu(tokens_per_s / run.env.world_size, run.flops_per_token, run.peak_flops),
        "mem/max_rank_gib": max_gpu,
        "mem/max_rank_rss_gib": max_rss,
        "world_size": run.env.world_size,
    }


def _every(step: int, n: int, last: int) -> bool:
    return step == last or (n > 0 and step % n == 0)


def save(run: Run, step: int) -> None:
    """Every rank saves its partition (a collective: never behind a rank guard).

    Non-finite weights are never saved: the last good checkpoint stays the latest.
    """
    if not checkpoint.weights_finite(run.engine):
        raise UserError(f"step {step}: the weights are not finite; no checkpoint written, the last "
                        f"good one stays in {run.run_dir / 'checkpoints'}; lower optim.lr and resume")
    state = {"step": step, "samples": step * run.plan.global_batch_size,
             "tokens": step * run.plan.tokens_per_step, "zero_stage": zero_stage(run.ds_config),
             "dtype": run.dtype,
             "config": run.cfg.to_dict()}
    tag = checkpoint.save(run.engine, run.run_dir / "checkpoints", step, state, run.env.rank,
                          run.env.world_size, run.cfg.checkpoint.keep)
    run.rank_log.info(f"saved checkpoint {tag}")


def maybe_resume(run: Run) -> int:
    """Load the resume point found at start, if any; returns the step to continue after."""
    if run.resume is None:
        return 0
    state = checkpoint.load(run.engine, run.resume, run.env.rank, run.env.world_size)
    run.say(f"resumed from {run.resume.load_dir / run.resume.tag} at step {state['step']}")
    return int(state["step"])


def generate_sample(run: Run) -> str:
    """Continue log.sample_prompt with the trained model (all ranks take part under ZeRO-3)."""
    import torch

    prompt = run.cfg.log.sample_prompt
    ids = run.tokenizer(prompt, return_tensors="pt").input_ids.to(run.engine.device)
    run.engine.eval()
    torch.manual_seed(run.cfg.seed)
    with torch.no_grad():
        out = run.engine.module.generate(
            ids, max_new_tokens=run.cfg.log.sample_tokens, min_new_tokens=run.cfg.log.sample_tokens,
            do_sample=True, top_k=40, temperature=0.8, use_cache=True,
            pad_token_id=run.tokenizer.eos_token_id, synced_gpus=zero_stage(run.ds_config) == 3)
    run.engine.train()
    return run.tokenizer.decode(out[0], skip_special_tokens=True)


class NonFiniteStop(UserError):
    exit_code = 3

    def __init__(self, step: int, in_a_row: int):
        super().__init__(f"step {step}: {in_a_row} consecutive steps with non-finite gradients "
                         f"(train.nonfinite=stop, train.nonfinite_patience={in_a_row}); none was "
                         f"applied and no checkpoint was written; resume from the last good one "
                         f"with a lower optim.lr or train.nonfinite=skip")


class OutOfMemory(UserError):
    exit_code = 4

    def __init__(self, run: Run, step: int):
        import torch

        from ds_train.dryrun import oom_report

        gib = torch.cuda.get_device_properties(run.engine.device).total_memory / 2**30
        super().__init__(f"step {step}: " + oom_report(run.cfg, run.ds_config, run.engine.module.config,
                                                       run.env.world_size, gib))


class StopRequest:
    """SIGTERM / SIGINT set a flag; the loop agrees on it across ranks at each step boundary."""

    SIGNALS = ("SIGTERM", "SIGINT")

    def __init__(self):
        import signal

        self.signum = 0
        self._previous = {}
        for name in self.SIGNALS:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def agreed(self) -> int:
        """The signal number if any rank got one (a collective: every rank calls it every step)."""
        return int(dist.all_reduce_max([float(self.signum)])[0])

    def restore(self) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def should_save(c: RunConfig, step: int) -> bool:
    every = c.checkpoint.every and step % c.checkpoint.every == 0
    return bool(every or (step == c.train.max_steps and c.checkpoint.save_final))


def train(cfg: RunConfig, ds_config_path: str) -> dict:
    run = build_run(cfg, ds_config_path, dist.detect_env())
    start = maybe_resume(run)
    if start >= cfg.train.max_steps:
        run.say(f"already trained to step {start} >= train.max_steps={cfg.train.max_steps}; "
                f"raise train.max_steps to continue, or set another output_dir")
    stop = StopRequest()
    try:
        metrics = train_loop(run, start, cfg.train.max_steps, stop)
    finally:
        stop.restore()
    if metrics.get("stopped_by_signal"):
        run.say(f"stopped by signal {metrics['stopped_by_signal']} at step {metrics['step']}; "
                f"checkpoint saved; launch the same command again to resume")
        run.logger.close()
        raise SystemExit(128 + metrics["stopped_by_signal"])
    return finish(run, metrics)


def train_loop(run: Run, start: int, stop: int, stop_request: StopRequest | None = None) -> dict[str, Any]:
    """Steps start+1 .. stop: next batch, step, maybe log, maybe eval, maybe save, maybe stop."""
    c, plan, last = run.cfg, run.plan, run.cfg.train.max_steps
    progress = build_progress(run.env.is_main, c.log.progress, last, start)
    metrics: dict[str, Any] = {}
    window_start, window_steps, skipped, in_a_row = time.perf_counter(), 0, 0, 0
    for step in range(start + 1, stop + 1):
        batches = rank_micro_batches(run.train_data, step - 1, plan.global_batch_size,
                                     plan.micro_batch_size, run.env.rank, run.env.world_size)
        log_now, eval_now = _every(step, c.log.every, last), _every(step, c.train.eval_every, last)
        try:
            result = train_step(run.engine, batches, poison=step in c.train.debug_nonfinite_steps)
        except Exception as e:  # torch.OutOfMemoryError on CUDA; the launcher then stops the others
            if type(e).__name__ != "OutOfMemoryError":
                raise
            progress.close()
            raise OutOfMemory(run, step) from None
        skipped, in_a_row = skipped + result.skipped, (in_a_row + 1) if result.skipped else 0
        window_steps += 1
        progress.update()
        if result.skipped:
            run.rank_log.info(f"step {step}: gradients not finite, update skipped")
            if c.train.nonfinite == "stop" and in_a_row >= c.train.nonfinite_patience:
                progress.close()
                raise NonFiniteStop(step, in_a_row)
        if log_now:
            metrics = step_metrics(run, step, result, skipped, time.perf_counter() - window_start,
                                   window_steps)
            progress.set_postfix_str(f"loss {metrics['train/loss']:.3f}")
        if eval_now:
            metrics = (metrics if log_now else {}) | evaluate(run)
        if log_now or eval_now:
            run.logger.log(metrics, step)
            window_start, window_steps = time.perf_counter(), 0
        signum = stop_request.agreed() if stop_request else 0
        if should_save(c, step) or signum:
            save(run, step)
        if signum:
            progress.close()
            return {"stopped_by_signal": signum, "step": step}
    progress.close()
    return metrics


def maybe_export_final(run: Run) -> str:
    """Rank 0 writes the HF directory from the final checkpoint (all ranks wait for the save)."""
    from ds_train.export import export

    dist.barrier()
    tag = checkpoint.tag_for(run.cfg.train.max_steps)
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
        (run.run_dir / "results.json").write_text(json.dumps(results, indent=2))
        if sample is not None:
            print(f"\n--- sample ---\n{sample}\n--------------")
        print(f"run directory: {results['run_dir']}")
    run.logger.close()
    dist.barrier()
    dist.release_shared_memory(run.env)
    return results
