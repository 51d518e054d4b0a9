"""Compiled layers beyond one-GPU ZeRO-2 pretraining: activation checkpointing, LoRA, DPO.

    python bench/gpu/compiled.py --out OUT [--layouts ckpt,lora,dpo] [--steps 10]
    python bench/gpu/compiled.py --out OUT --reduced --data DIR      # the CPU check the suite runs

The memory plan counts compiled layers wherever the run compiles them (model.compile, auto on a GPU
except where config.model.eager_layers leaves them eager; ds_train/plan/memory.py: fused kernels keep
half the MLP's activations and no fp32 copy of a norm's input); the 2026-11-26 leases measured that
under one-GPU ZeRO-2 pretraining alone. Here each layout runs twice, compiled
(ds_train's default on a GPU) and eager (model.compile=false), as the two jobs of one process
(ds_train's parity worker; each run's peak is its own: build_run resets the device's peak):

  ckpt  the ~124M Llama from scratch, seq 2048, micro-batch 8, model.activation_checkpointing=true
  lora  LoRA rank 16 on all linear layers of that Llama (model.path: written here from its config,
        with the bundled corpus's tokenizer), seq 2048, micro-batch 8
  dpo   DPO (sigmoid, reference precomputed) on that model, recipes/data/preference_pairs.jsonl,
        seq 64 with longer sides truncated (data.overlong=truncate), micro-batch 64 pairs: the plan
        takes every sequence at seq_len, and a batch pads to its longest, so the data must reach it
        (at seq 512 the pairs, ~66 tokens a side, measured less than half the plan: 2026-11-28)

For each run: the plan's per-GPU peak (ds-train estimate's arithmetic, run_estimate, one GPU of this
device) against the measured one (mem/max_rank_gib: torch.cuda.max_memory_allocated), the issue
asking |error| <= 10%; and for each layout the compiled run's logged losses against eager's, step by
step (bf16: within 2% relative, about 2.5 bf16 ulps). results: OUT/compiled.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (LLAMA_124M, ROOT, add_common_args, launch_jobs, metrics, run_config, start, tail,  # noqa: E402
                    write_results)
from bench import cli  # noqa: E402

LAYOUTS = ("ckpt", "lora", "dpo")
DS_CONFIG = ROOT / "ds_configs" / "zero2.json"
TOLERANCE = 0.10  # the plan against the measured peak
LOSS_TOLERANCE = 0.02  # compiled against eager, relative, at every logged step
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {', '.join(LAYOUTS)}")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run, each logged (default 10)")
    args = p.parse_args(argv)
    args.layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if bad := [x for x in args.layouts if x not in LAYOUTS]:
        p.error(f"--layouts: unknown {bad}; choose from {', '.join(LAYOUTS)}")
    if args.reduced:
        args.steps = min(args.steps, 3)
    return args


def write_policy(out: Path, model: dict, data: str) -> Path:
    """A Hugging Face directory of `model` from scratch (ds_train's seeded init), with the corpus's
    tokenizer: the base LoRA and DPO start from."""
    import torch
    from transformers import AutoConfig

    from ds_train.data.tokenizer import load_tokenizer
    from ds_train.model.build import from_scratch

    where = out / "policy"
    if (where / "config.json").is_file():
        return where
    tokenizer = load_tokenizer(Path(data) / "tokenizer")
    kwargs = dict(model)
    hf = AutoConfig.for_model(kwargs.pop("model_type"), **{**kwargs, "vocab_size": len(tokenizer)})
    built, _ = from_scratch(hf, 1234, False, dtype=torch.float32)
    built.save_pretrained(where)
    tokenizer.save_pretrained(where)
    return where


def layout_config(args, out: Path, layout: str, model: dict, seq: int, dtype: str, compiled: bool,
                  policy: Path) -> Path:
    name = f"{layout}_{'compiled' if compiled else 'eager'}"
    micro = 2 if args.reduced else (64 if layout == "dpo" else 8)
    common = dict(micro=micro, global_batch=micro, steps=args.steps, dtype=dtype, compile=compiled, log_every=1)
    if layout == "ckpt":
        return run_config(out, name, model, args.data, seq=seq, ckpt=True, **common)
    if layout == "lora":
        return run_config(out, name, model, args.data, seq=seq, **common,
                          model_keys={"path": str(policy), "config": {},
                                      "lora": {"rank": 16, "alpha": 32, "target_modules": ["all-linear"]}})
    path = run_config(out, name, model, str(out / "pairs"), seq=64, **common,
                      model_keys={"path": str(policy), "config": {}},
                      dpo={"loss": "sigmoid", "beta": 0.1, "reference": "precomputed"})
    cfg = yaml.safe_load(path.read_text())
    cfg["data"].update(sources=[str(ROOT / "recipes" / "data" / "preference_pairs.jsonl")], format="preference",
                       chat_template=CHATML, val_fraction=0.1, overlong="truncate")
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def predicted_gib(cfg_path: Path) -> float:
    """The plan's per-GPU peak of this run on one GPU of this device (80 GiB on a CPU: a number only)."""
    import torch

    from ds_train.config.file import load_config
    from ds_train.estimate import run_estimate
    from ds_train.plan.planner import Target

    gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 80.0
    rows = run_estimate(load_config(str(cfg_path), []), str(DS_CONFIG), Target(1, 1, gib), None)["rows"]
    return next(r for r in rows if r["given"])["gpu_peak_gib"]


def measure(args, out: Path, layout: str, model: dict, seq: int, dtype: str, policy: Path) -> dict:
    """The layout compiled, then eager, as two jobs of one process."""
    cfgs = {compiled: layout_config(args, out, layout, model, seq, dtype, compiled, policy)
            for compiled in (True, False)}
    jobs = [(cfg.stem, cfg, {}) for cfg in cfgs.values()]
    rc, wall, log = launch_jobs(out, layout, jobs, str(DS_CONFIG), args.timeout)
    row: dict = {"layout": layout, "wall_s": wall}
    if rc:
        return {**row, "error": f"exit {rc}", "log_tail": tail(log)}
    runs = {}
    for compiled, cfg in cfgs.items():
        recs = [r for r in metrics(out / "runs" / cfg.stem) if "train/loss" in r]
        predicted = predicted_gib(cfg)
        measured = max((r.get("mem/max_rank_gib") or 0.0) for r in recs) if recs else 0.0
        runs["compiled" if compiled else "eager"] = {
            "losses": [r["train/loss"] for r in recs], "predicted_gib": predicted, "measured_gib": measured,
            "relative_error": predicted / measured - 1 if measured > 0 else None,
            "step_time_s": recs[-1].get("perf/step_time_s") if recs else None}
    a, b = runs["compiled"]["losses"], runs["eager"]["losses"]
    diffs = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)]
    return {**row, "runs": runs, "error": None if len(a) == len(b) == args.steps else "steps missing",
            "loss_max_rel_diff": max(diffs, default=None),
            "losses_within": bool(diffs) and max(diffs) <= LOSS_TOLERANCE}


def main(argv=None) -> int:
    args = parse_args(argv)
    out, model, seq, dtype = start(args, LLAMA_124M)
    policy = write_policy(out, model, args.data)
    rows = []
    for layout in args.layouts:
        row = measure(args, out, layout, model, seq, dtype, policy)
        rows.append(row)
        if row["error"]:
            print(f"{layout}: FAILED {row['error']}\n{row.get('log_tail', '')}", flush=True)
            continue
        for side, r in row["runs"].items():
            err = r["relative_error"]
            print(f"{layout:5s} {side:8s} predicted {r['predicted_gib']:6.2f} GiB  "
                  f"measured {r['measured_gib']:6.2f} GiB"
                  + (f"  error {err:+.1%}" if err is not None else "") + f"  step {r['step_time_s'] or 0:.3f} s",
                  flush=True)
        print(f"{layout:5s} losses compiled vs eager: max relative difference {row['loss_max_rel_diff']:.2e}",
              flush=True)
        write_results(out, "compiled", summary(args, rows, model, seq, dtype))
    path = write_results(out, "compiled", summary(args, rows, model, seq, dtype))
    print(f"results: {path}")
    return 1 if any(r["error"] for r in rows) else 0


def summary(args, rows: list[dict], model: dict, seq: int, dtype: str) -> dict:
    errors = [abs(r["relative_error"]) for row in rows if not row["error"] for r in row["runs"].values()
              if r["relative_error"] is not None]
    return {"what": "compiled layers under checkpointing, LoRA, DPO: plan vs measured peak, losses vs eager",
            "model": model, "seq_len": seq, "dtype": dtype, "steps": args.steps, "layouts": rows,
            "max_abs_error": max(errors, default=None), "tolerance": TOLERANCE,
            "loss_tolerance": LOSS_TOLERANCE, "reduced": args.reduced}


if __name__ == "__main__":
    sys.exit(cli.run(main))
