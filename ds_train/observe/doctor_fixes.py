"""What `ds-train doctor` tells a user to do about each class of finding, the first fix first. A
CUDA out-of-memory in a run directory gets the memory plan's fix: the cheapest change the planner
says fits this run on GPUs of the size the error names."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import yaml

from ds_train.checkpoint.rundir import read_json_or_none
from ds_train.errors import UserError


def _match(f, pattern: str) -> str:
    for e in f.evidence + f.context:
        m = re.search(pattern, e)
        if m:
            return next((g for g in m.groups() if g is not None), "")
    return ""


def _planned_fix(view, gpu_gib: float) -> list[str]:
    """The cheapest change the memory planner says fits this run on GPUs of `gpu_gib`."""
    from ds_train.config.file import load_config
    from ds_train.plan.planner import Target, ds_config_dtype, pick_preset, plan_rows, suggestions

    try:
        cfg = load_config(str(view.paths.config), [])
        ds_config = read_json_or_none(view.paths.ds_config) or {}
        from ds_train.plan.memory import model_shape
        from ds_train.model.hfconfig import build_hf_config

        # The run's own model config (hf_model/, written at start-up), else the config's, vocabulary as planned.
        model = replace(cfg.model, path=str(view.paths.hf_model), config={}) \
            if (view.paths.hf_model / "config.json").is_file() else cfg.model
        shape = model_shape(build_hf_config(model, int(cfg.model.config.get("vocab_size") or cfg.data.vocab_size),
                                            cfg.train.seq_len, weights=False), cfg.model.lora)
    except (UserError, OSError, ValueError, KeyError, TypeError) as e:
        return [f"(the memory plan needs the run's config.yaml and ds_config.json: {str(e).splitlines()[0][:120]})"]
    world = int(view.env.get("world_size") or 1)
    target = Target(1, world, gpu_gib)
    dtype = ds_config_dtype(ds_config)
    zero = ds_config.get("zero_optimization", {"stage": 0})
    given = next((r for r in plan_rows(shape, cfg, zero, target, dtype) if r["given"]), None)
    plan = f" (this run: {given['gpu_peak_gib']:.1f} GiB planned)" if given else ""
    for s in suggestions(shape, cfg, zero, target, dtype):
        if s["fits"]:
            return [f"{s['change']}: the memory plan puts the per-GPU peak at {s['gpu_peak_gib']:.1f} GiB of "
                    f"{gpu_gib:.1f} GiB{plan}"]
    try:
        p = pick_preset(shape, cfg, target, dtype, "balanced")
    except UserError as e:
        return [str(e)]
    return [f"--ds-config {p['ds_config']} {p['overrides']}: the memory plan puts the per-GPU peak at "
            f"{p['gpu_peak_gib']:.1f} GiB of {gpu_gib:.1f} GiB{plan}"]


MISSING_MODULE = r"No module named '([^']+)'"
# class -> its fixes, as text with placeholders (the prose lives in a data file of its own)
FIXES: dict[str, list[str]] = yaml.safe_load(Path(__file__).with_name("doctor_fixes.yaml").read_text())


def fixes(f, view) -> list[str]:
    """What to do about finding `f` (of the run directory `view`, if any), the first fix first."""
    values = {"on": f" on {f.where}" if f.where else "", "who": f.where or "a rank",
              "module": _match(f, MISSING_MODULE) or "?",
              "stuck": f"{f.where} stopped making progress" if f.where else
                       "the hang report names the rank that never arrived"}
    planned = []
    if f.cls == "cuda_oom" and view is not None:
        gib = _match(f, r"total capacity of ([\d.]+) GiB|world \d+, ([\d.]+) GiB each")  # torch's line, or ours
        planned = _planned_fix(view, float(gib)) if gib else []
    return planned + [line.format(**values) for line in FIXES[f.cls]]
