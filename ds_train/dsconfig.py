"""A DeepSpeed JSON template (--ds-config, ds_configs/*.json): read, its ZeRO section's "auto" sizes
derived, and what DeepSpeed would do with its scheduler and optimizer sections, checked before it builds
them: a known schedule, the arguments its class takes and its numbers in range; an Adam's arguments
against the class DeepSpeed picks. Each wrong value is one line (DeepSpeed raised a traceback from
deepspeed.initialize, after the run directory was written)."""

from __future__ import annotations

import difflib
import math
from pathlib import Path

from ds_train.errors import UserError
from ds_train.fs import read_json

AUTO = "auto"


def read_ds_template(path: str | Path) -> dict:
    """The DeepSpeed JSON given as --ds-config; one line naming it when it cannot be read."""
    return read_json(Path(path), "DeepSpeed JSON file", "--ds-config", hint="see ds_configs/ for the ZeRO stages")


def resolve_zero(zero: dict, hidden: int) -> dict:
    """A zero_optimization section with its "auto" bucket sizes derived from the hidden size (the
    Hugging Face Trainer's rule, for every stage): the one place they are computed, for the run's
    ds_config and for the memory plan alike. Explicit values and missing keys (DeepSpeed's
    defaults) are left as they are."""
    derived = {"reduce_bucket_size": hidden * hidden,
               "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
               "stage3_param_persistence_threshold": 10 * hidden}
    return {**zero, **{key: value for key, value in derived.items() if zero.get(key) == AUTO}}


def shipped_zero(name: str) -> dict:
    """The zero_optimization section of ds_configs/<name>.json (zero0 ... zero3, zero3_offload): what
    a user switching to that file gets (the memory plan's other rows and fixes)."""
    path = Path(__file__).resolve().parents[1] / "ds_configs" / f"{name}.json"
    return dict(read_ds_template(path)["zero_optimization"])


# The numbers of DeepSpeed's schedules (deepspeed/runtime/lr_schedules.py), each declared once: the type it
# must be and its inclusive bounds (None: open). DeepSpeed passes scheduler.params to the class as they are.
SCHEDULE_PARAMS = {
    "total_num_steps": (int, 1, None), "warmup_num_steps": (int, 1, None), "last_batch_iteration": (int, -1, None),
    "warmup_min_ratio": (float, 0, 1), "cos_min_ratio": (float, 0, 1), "warmup_min_lr": (float, 0, None),
    "warmup_max_lr": (float, 0, None), "lr_range_test_min_lr": (float, 0, None),
    "lr_range_test_step_size": (int, 1, None), "lr_range_test_step_rate": (float, 0, None),
    "lr_range_test_staircase": (bool, None, None), "cycle_min_lr": (float, 0, None), "cycle_max_lr": (float, 0, None),
    "decay_lr_rate": (float, 0, None), "cycle_first_step_size": (int, 1, None),
    "cycle_second_step_size": (int, 1, None),
    "cycle_first_stair_count": (int, 0, None), "cycle_second_stair_count": (int, 0, None),
    "decay_step_size": (int, 0, None), "cycle_momentum": (bool, None, None), "cycle_min_mom": (float, 0, 1),
    "cycle_max_mom": (float, 0, 1), "decay_mom_rate": (float, 0, None),
}
WARMUP_TYPES = ("linear", "log")


def _bad_number(value, kind: type, low, high) -> str | None:
    """What is wrong with `value` as a `kind` within [low, high], or None."""
    if kind is bool:
        return None if isinstance(value, bool) else "true or false"
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not numeric or kind is int and not isinstance(value, int) or not math.isfinite(value):
        return "an integer" if kind is int else "a finite number"
    if low is not None and value < low or high is not None and value > high:
        return f"within [{low}, {high}]" if high is not None else f">= {low}"
    return None


def schedule_class(section, source: str) -> type:
    """The class DeepSpeed builds a scheduler section with (its own schedules, then torch's), or one line."""
    import torch
    from deepspeed.runtime import lr_schedules

    kind = section.get("type") if isinstance(section, dict) else None
    cls = getattr(lr_schedules, kind, None) if isinstance(kind, str) else None
    cls = cls or (getattr(torch.optim.lr_scheduler, kind, None) if isinstance(kind, str) else None)
    if not isinstance(cls, type):
        raise UserError(f"{source}: scheduler.type={kind!r} is not a schedule DeepSpeed knows; use one of "
                        f"{', '.join(lr_schedules.VALID_LR_SCHEDULES)} (or a torch.optim.lr_scheduler class)")
    if not isinstance(section.get("params", {}), dict):
        raise UserError(f"{source}: scheduler.params must be an object of {kind}'s arguments")
    return cls


def check_scheduler(ds: dict, source: str) -> None:
    """The scheduler section as DeepSpeed builds it (`type(optimizer, **params)`): a type it knows, names
    its class takes, and DeepSpeed's schedule numbers of the right type, finite and in range. A template's
"auto" values are skipped: checked once the trainer has filled them."""
    import inspect

    from deepspeed.runtime import lr_schedules

    if "scheduler" not in ds:
        return
    cls = schedule_class(ds["scheduler"], source)
    kind, params = ds["scheduler"]["type"], ds["scheduler"].get("params", {})
    takes = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "optimizer")]
    for key, value in params.items():
        if value == "auto":  # the trainer fills it (render_ds_config), then the rendered section is checked
            continue
        if key not in takes:
            close = difflib.get_close_matches(key, takes, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; it takes {', '.join(takes)}"
            raise UserError(f"{source}: scheduler.params.{key}: {kind} takes no such argument{hint}")
        if key == "warmup_type" and value not in WARMUP_TYPES:
            raise UserError(f"{source}: scheduler.params.warmup_type={value!r} must be one of {WARMUP_TYPES} "
                            f"(DeepSpeed would fall back to 'log' with a warning)")
        if key in SCHEDULE_PARAMS and cls.__module__ == lr_schedules.__name__ and not (
                value is None and key == "warmup_max_lr"):
            wrong = _bad_number(value, *SCHEDULE_PARAMS[key])
            if wrong:
                raise UserError(f"{source}: scheduler.params.{key}={value!r} must be {wrong}")


# The keys of optimizer.params DeepSpeed takes out before it builds an Adam (deepspeed/runtime/engine.py
# _configure_basic_optimizer, get_optimizer_configuration); the rest go to the optimizer's class.
DEEPSPEED_ADAM_KEYS = ("torch_adam", "adam_w_mode", "fp32_optimizer_states", "foreach")


def check_optimizer(ds: dict, source: str) -> None:
    """An Adam/AdamW section's params as DeepSpeed hands them to the class it builds (torch's AdamW with
    torch_adam, DeepSpeedCPUAdam under offload, else FusedAdam): a name that class does not take was a
    TypeError traceback from deepspeed.initialize, after the run directory was written."""
    import inspect

    opt = ds.get("optimizer")
    if not isinstance(opt, dict) or str(opt.get("type", "")).lower() not in ("adam", "adamw"):
        return
    params = opt.get("params", {})
    if "max_grad_norm" in params:
        raise UserError(f"{source}: optimizer.params.max_grad_norm: DeepSpeed clips by gradient_clipping; "
                        f"remove it and set train.grad_clip")
    if params.get("torch_adam"):
        import torch
        cls = torch.optim.AdamW
    elif ((ds.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device") in ("cpu", "nvme"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam as cls
    else:
        from deepspeed.ops.adam import FusedAdam as cls
    takes = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params", "model_params")]
    takes += [k for k in DEEPSPEED_ADAM_KEYS if k not in takes]
    for key in params:
        if key not in takes:
            close = difflib.get_close_matches(key, takes, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; it takes {', '.join(takes)}"
            raise UserError(f"{source}: optimizer.params.{key}: {cls.__name__} takes no such argument{hint}")
