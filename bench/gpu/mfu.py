"""MFU and tokens/s of a ~1B Llama: ds_train against a bare DeepSpeed loop and the HF Trainer.

    python bench/gpu/mfu.py --out OUT [--sides ds_train,bare,hf,eager,liger,fused_loss,ckpt] [--steps 20]
    python bench/gpu/mfu.py --out OUT --reduced --data DIR      # the CPU check the suite runs

One GPU, ZeRO-2 (ds_configs/zero2.json), bf16, seq 2048, micro-batch 8 x accumulation 4. Sides,
each in its own process, one after another (--reduced: the ds_train sides as jobs of one process,
ds_train's parity worker, and bare and hf in one more: the CPU check imports torch and DeepSpeed twice,
not once a side):

  ds_train  `ds-train train` with its defaults (on a GPU: each decoder layer compiled) on the bundled
            corpus; tokens/s between its log records after warm-up
  bare      deepspeed.initialize on the same HF model with the ds_config ds_train rendered, then
            forward (HF loss) / engine.backward / engine.step on random tokens, nothing else
  hf        the Hugging Face Trainer with that same ds_config (every value it owns agrees), random
            tokens, timed by a callback from the end of warm-up to the last step
  eager     ds_train with model.compile=false
  liger     ds_train with model.liger_kernels=true (Liger's RMSNorm, RoPE and SwiGLU)
  fused_loss  ds_train with train.fused_loss=true (the loss's gradients computed in its forward)
  ckpt      ds_train with model.activation_checkpointing=true
  compile   ds_train with model.compile=true (its default on a GPU; the CPU check's compiled side)
  liger_max ds_train with Liger's kernels and compiled layers at the largest micro-batch the memory plan
            says fits this GPU with the memory they free (ds-train estimate's arithmetic; accumulation
            as given, so more tokens a step)

Every side times the same steps (after --warmup) with the device synchronised at both ends, and
MFU = tokens/s x (6 N + 12 L h s) / peak, one formula for all. results: OUT/mfu.json, rewritten
after each side (a side cut off by a time limit leaves the others' figures).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (LLAMA_1B, ROOT, add_common_args, ds_train, launch, launch_jobs, metrics,  # noqa: E402
                    run_config, start, tail, versions, write_results)
from bench import cli  # noqa: E402

SIDES = ("ds_train", "bare", "hf", "eager", "liger", "fused_loss", "ckpt", "compile", "liger_max")
# a ds_train side -> what it changes in the run config (run_config's arguments)
DS_TRAIN_SIDES = {"ds_train": {}, "eager": {"compile": False}, "liger": {"model_keys": {"liger_kernels": True}},
                  "fused_loss": {"train": {"fused_loss": True}}, "ckpt": {"ckpt": True}, "compile": {"compile": True},
                  "liger_max": {"model_keys": {"liger_kernels": True}}}
DS_CONFIG = ROOT / "ds_configs" / "zero2.json"


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, from {', '.join(SIDES)}")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per side (default 20)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    p.add_argument("--micro", type=int, default=8, help="micro-batch size (default 8)")
    p.add_argument("--accum", type=int, default=4, help="gradient accumulation steps (default 4)")
    p.add_argument("--side", help=argparse.SUPPRESS)  # a worker process: bare, hf, or both (bare,hf)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--ds-config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if unknown := [s for s in args.sides if s not in SIDES]:
        p.error(f"--sides: unknown {unknown}; choose from {', '.join(SIDES)}")
    if args.side and not set(args.side.split(",")) <= {"bare", "hf"}:
        p.error(f"--side {args.side}: bare, hf or both (bare,hf)")
    if args.reduced:
        args.steps, args.warmup, args.micro, args.accum = min(args.steps, 4), min(args.warmup, 2), 2, 2
    if args.steps <= 0 or args.warmup <= 0:
        p.error("--steps and --warmup must be positive")
    return args


# ---------------------------------------------------------------- worker sides (own process each)
def load_run(config: str):
    """The model config, batch and rendered ds_config of the ds_train side's run."""
    import yaml

    cfg = yaml.safe_load(Path(config).read_text())
    return cfg, cfg["train"]


def build_model(cfg: dict):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(cfg["model"]["config"])
    hf = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    if hf.vocab_size is None or "vocab_size" not in cfg["model"]["config"]:
        from ds_train.data.tokenizer import load_tokenizer

        hf.vocab_size = len(load_tokenizer(Path(cfg["data"]["dir"]) / "tokenizer"))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa"), hf


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def side_bare(args) -> dict:
    """The DeepSpeed tutorial's loop: initialize, then forward / backward / step. Its start-up is clocked
    as ds_train clocks its own (ds_train/observe/startup.py): imports, model, engine, first step, from
    the process's creation."""
    from ds_train.observe.startup import StartupClock

    clock = StartupClock.begin()  # torch, DeepSpeed, transformers
    import deepspeed
    import torch

    cfg, train = load_run(args.config)
    ds_config = json.loads(Path(args.ds_config).read_text())
    model, hf = build_model(cfg)
    clock.mark("model")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                      config=ds_config)
    clock.mark("engine")
    micro, seq, gas = train["micro_batch_size"], train["seq_len"], ds_config["gradient_accumulation_steps"]
    gen = torch.Generator().manual_seed(0)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            synchronize()
            t0 = time.perf_counter()
        for _ in range(gas):
            x = torch.randint(0, hf.vocab_size, (micro, seq), generator=gen).to(engine.device)
            loss = engine(input_ids=x, labels=x, use_cache=False).loss
            engine.backward(loss)
            engine.step()
        if step == 0:
            synchronize()
            clock.finish("first step")
    synchronize()
    return {"seconds": time.perf_counter() - t0, "steps": args.steps,
            "params": sum(p.numel() for p in model.parameters()),
            "startup_s": clock.phases()}


def side_hf(args) -> dict:
    """The HF Trainer with the same ds_config; TrainingArguments agree with every value it checks."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    cfg, train = load_run(args.config)
    ds_config = json.loads(Path(args.ds_config).read_text())
    model, hf = build_model(cfg)
    micro, seq, gas = train["micro_batch_size"], train["seq_len"], ds_config["gradient_accumulation_steps"]
    total = args.warmup + args.steps
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, hf.vocab_size, (total * gas * micro, seq), generator=gen)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return {"input_ids": rows[i], "labels": rows[i]}

    marks = {}

    class Clock(TrainerCallback):
        def on_step_end(self, _args, state, control, **kw):
            if state.global_step in (args.warmup, total):
                synchronize()
                marks[state.global_step] = time.perf_counter()

    opt, sched = ds_config["optimizer"]["params"], ds_config["scheduler"]["params"]
    targs = TrainingArguments(
        output_dir=str(Path(args.out) / "runs" / "hf"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=gas, max_steps=total, learning_rate=opt["lr"],
        adam_beta1=opt["betas"][0], adam_beta2=opt["betas"][1], adam_epsilon=opt["eps"],
        weight_decay=opt["weight_decay"], warmup_steps=sched["warmup_num_steps"],
        max_grad_norm=ds_config["gradient_clipping"],
        bf16=ds_config.get("bf16", {}).get("enabled", False), deepspeed=ds_config, save_strategy="no",
        report_to=[], logging_steps=10**6, disable_tqdm=True, dataloader_num_workers=0,
        remove_unused_columns=False, seed=0, use_cpu=not torch.cuda.is_available())
    Trainer(model=model, args=targs, train_dataset=Rows(), callbacks=[Clock()]).train()
    return {"seconds": marks[total] - marks[args.warmup], "steps": args.steps,
            "params": sum(p.numel() for p in model.parameters())}


# ---------------------------------------------------------------- the driver
def ds_train_config(args, out: Path, name: str, model: dict, seq: int, dtype: str, **flags) -> Path:
    log_every = args.warmup if args.warmup <= args.steps else 1
    return run_config(out, name, model, args.data, seq=seq, micro=args.micro, global_batch=args.micro * args.accum,
                      steps=args.warmup + args.steps, dtype=dtype, log_every=log_every, **flags)


def ds_train_result(args, out: Path, name: str, cfg: Path, wall: float) -> dict:
    """A ds_train side's timed steps, from its run directory's log records."""
    # The logged windows after warm-up: each is the wall time of the steps since the last log record
    # (the final evaluation, written into the last record, comes after its window closes).
    recs = [r for r in metrics(out / "runs" / name) if "perf/step_time_s" in r]
    if not recs:
        return {"error": "no timed steps logged", "log_tail": tail(out / "runs" / name / "logs" / "rank_0.log")}
    steps = [r["step"] for r in recs]
    timed = [(r, r["step"] - prev) for prev, r in zip(steps, recs[1:]) if prev >= args.warmup]
    seconds = sum(r["perf/step_time_s"] * n for r, n in timed)
    end = recs[-1]
    env = json.loads((out / "runs" / name / "env.json").read_text())
    startup = json.loads((out / "runs" / name / "results.json").read_text()).get("startup_s")
    return {"seconds": seconds, "steps": sum(n for _, n in timed), "wall_s": wall, "config": str(cfg),
            "dtype": env.get("dtype"), "logged_mfu_last": end.get("perf/mfu"), "peak_gib": end.get("mem/max_rank_gib"),
            "startup_s": startup}


def largest_micro(args, model: dict, seq: int, dtype: str, out: Path, **flags) -> tuple[int, float]:
    """The largest micro-batch (at most 8x --micro) whose plan fits one GPU of this device's memory (the
    CPU check: 80 GiB), with the side's flags; and its predicted peak (GiB)."""
    import torch

    from ds_train.config.file import load_config
    from ds_train.estimate import run_estimate
    from ds_train.plan.planner import Target

    gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 80.0
    best = (args.micro, 0.0)
    for micro in range(args.micro, 8 * args.micro + 1, max(args.micro // 4, 1)):
        cfg = run_config(out, "plan", model, args.data, seq=seq, micro=micro, global_batch=micro * args.accum,
                         steps=1, dtype=dtype, **flags)
        row = next(r for r in run_estimate(load_config(str(cfg), []), str(DS_CONFIG), Target(1, 1, gib), None)["rows"]
                   if r["given"])
        if not row["fits"]:
            break
        best = (micro, row["gpu_peak_gib"])
    return best


def side_setup(args, out: Path, name: str, model: dict, seq: int, dtype: str) -> tuple:
    """(the side's args, its run config, what its result adds): liger_max takes the largest micro-batch
    the plan says fits."""
    flags, extra = dict(DS_TRAIN_SIDES[name]), {}
    if name == "liger_max":
        micro, predicted = largest_micro(args, model, seq, dtype, out, **flags)
        args = argparse.Namespace(**{**vars(args), "micro": micro})
        flags["train"] = {"micro_batch_size": micro, "global_batch_size": micro * args.accum}
        extra["predicted_gib"] = predicted
        print(f"liger_max: micro-batch {micro}, the plan's peak {predicted:.1f} GiB", flush=True)
    return args, ds_train_config(args, out, name, model, seq, dtype, **flags), {**extra, "micro_batch_size": args.micro}


def ds_train_side(args, out: Path, name: str, model: dict, seq: int, dtype: str) -> dict:
    args, cfg, extra = side_setup(args, out, name, model, seq, dtype)
    log = out / "logs" / f"{name}.log"
    rc, wall = launch(ds_train("train", "--config", str(cfg), "--ds-config", str(DS_CONFIG)), log, args.timeout)
    if rc:
        return {"error": f"exit {rc}", "log_tail": tail(log)}
    return {**ds_train_result(args, out, name, cfg, wall), **extra}


def ds_train_sides_in_one_process(args, out: Path, names: list[str], model: dict, seq: int, dtype: str) -> dict:
    """--reduced: the ds_train sides as the jobs of one process; wall_s is that process's."""
    setups = {name: side_setup(args, out, name, model, seq, dtype) for name in names}
    rc, wall, log = launch_jobs(out, "ds_train_sides", [(name, cfg, {}) for name, (_, cfg, _) in setups.items()],
                                str(DS_CONFIG), args.timeout)
    if rc:
        return {name: {"error": f"exit {rc}", "log_tail": tail(log)} for name in names}
    return {name: {**ds_train_result(a, out, name, cfg, wall), **extra} for name, (a, cfg, extra) in setups.items()}


def worker_sides(args, out: Path, sides: list[str]) -> dict:
    """bare and hf, each in its own process (--reduced: both in one)."""
    run = out / "runs" / "ds_train"
    if not (run / "ds_config.json").is_file():
        return {side: {"error": "needs the ds_train side first (its rendered ds_config.json)"} for side in sides}
    results = {}
    for group in ([sides] if args.reduced else [[side] for side in sides]):
        name = ",".join(group)
        log = out / "logs" / f"{name.replace(',', '_')}.log"
        rc, wall = launch([sys.executable, __file__, "--side", name, "--out", str(out), "--data", args.data,
                           "--config", str(out / "configs" / "ds_train.yaml"), "--ds-config",
                           str(run / "ds_config.json"), "--steps", str(args.steps), "--warmup", str(args.warmup)],
                          log, args.timeout)
        for side in group:
            result = out / f"{side}.side.json"
            results[side] = ({**json.loads(result.read_text()), "wall_s": wall} if not rc and result.is_file()
                             else {"error": f"exit {rc}", "log_tail": tail(log)})
    return results


def summarise(args, sides: dict, model: dict, seq: int) -> dict:
    from transformers import AutoConfig

    from ds_train.observe.metrics import peak_flops
    from ds_train.model.build import flops_per_token, lookup_params

    v = versions()
    kwargs = dict(model)
    hf = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    params = next((s["params"] for s in sides.values() if "params" in s), None)
    peak = peak_flops(v["device"], 0.0) if v["device"] != "cpu" else None
    tokens_per_step = args.micro * args.accum * seq
    for s in sides.values():
        if "seconds" in s:
            s["tokens_per_s"] = s.get("micro_batch_size", args.micro) * args.accum * seq * s["steps"] / s["seconds"]
            if params and peak:
                fpt = flops_per_token(params, hf.num_hidden_layers, hf.hidden_size, seq, lookup_params(hf))
                s["mfu"] = s["tokens_per_s"] * fpt / peak
    ratio = {}
    base = sides.get("ds_train", {}).get("tokens_per_s")
    for other in sides:
        if base and other != "ds_train" and sides[other].get("tokens_per_s"):
            ratio[f"ds_train/{other}"] = base / sides[other]["tokens_per_s"]
    return {"what": "tokens/s and MFU, one GPU, ZeRO-2", "model": model, "params": params, "seq_len": seq,
            "micro_batch_size": args.micro, "grad_accum": args.accum, "tokens_per_step": tokens_per_step,
            "warmup_steps": args.warmup, "timed_steps": args.steps, "peak_flops": peak, "sides": sides,
            "ratios": ratio, "targets": {"ds_train/bare": 1.0, "ds_train/hf": 1.05, "mfu": 0.45},
            "reduced": args.reduced, "versions": v}


def measure(args, out: Path, model: dict, seq: int, dtype: str):
    """Each side's result as it is measured (name, result): in the order asked, or under --reduced
    the ds_train sides first, together, then bare and hf together."""
    ours = [side for side in args.sides if side in DS_TRAIN_SIDES]
    theirs = [side for side in args.sides if side not in DS_TRAIN_SIDES]
    if args.reduced:
        yield from ds_train_sides_in_one_process(args, out, ours, model, seq, dtype).items()
        yield from (worker_sides(args, out, theirs) if theirs else {}).items()
        return
    for side in args.sides:
        if side in DS_TRAIN_SIDES:
            yield side, ds_train_side(args, out, side, model, seq, dtype)
        else:
            yield side, worker_sides(args, out, [side])[side]


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    if args.side:  # a worker: measure its side(s), write each, exit
        for side in args.side.split(","):
            result = side_bare(args) if side == "bare" else side_hf(args)
            (out / f"{side}.side.json").write_text(json.dumps(result))
        return 0
    out, model, seq, dtype = start(args, LLAMA_1B)
    measured = {}
    for side, s in measure(args, out, model, seq, dtype):
        measured[side] = s
        tokens = s.get("micro_batch_size", args.micro) * args.accum * seq * s.get("steps", 0)
        print(f"{side}: " + (f"{tokens / s['seconds']:,.0f} tokens/s"
                             if "seconds" in s else f"FAILED {s['error']}\n{s.get('log_tail', '')}"), flush=True)
        sides = {k: measured[k] for k in args.sides if k in measured}  # in the order asked
        results = summarise(args, sides, model, seq)
        path = write_results(out, "mfu", results)  # after every side: a later one cut off keeps these
    for side, s in sides.items():
        mfu = f", MFU {s['mfu']:.1%}" if s.get("mfu") else ""
        if "tokens_per_s" in s:
            print(f"  {side:9s} {s['tokens_per_s']:>12,.0f} tokens/s{mfu}")
    for k, r in results["ratios"].items():
        print(f"  {k}: {r:.3f}")
    print(f"results: {path}")
    return 1 if any("error" in s for s in sides.values()) else 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
