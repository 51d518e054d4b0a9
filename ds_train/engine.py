"""Renders the final DeepSpeed config from a ds_configs/*.json template and the run config.

The JSON holds the engine knobs (stage, offload, overlap, buckets); the run config holds the
numbers. Every "auto" is resolved here, explicit values that disagree with the run config are
errors naming both, and unknown keys are errors (DeepSpeed itself ignores them: USERS.md trap 10).
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import os
import re
import shutil
from pathlib import Path
from typing import Any

from ds_train import dist
from ds_train.config import RunConfig
from ds_train.dsconfig import AUTO, check_optimizer, check_scheduler, resolve_zero, schedule_class
from ds_train.errors import UserError
from ds_train.model.workarounds import defer_muon_compile, output_capture_registry_takes_keys
from ds_train.plan.batch import BatchPlan
from ds_train.plan.experts import check_autoep_section

# Top-level keys DeepSpeed 0.19 reads (deepspeed/runtime/config.py and the feature configs).
KNOWN_TOP_LEVEL = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print",
    "dump_state", "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "amp", "torch_autocast", "gradient_clipping",
    "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "zero_optimization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "activation_checkpointing", "aio",
    "flops_profiler", "wall_clock_breakdown", "memory_breakdown", "tensorboard", "wandb", "csv_monitor", "comet",
    "comms_logger", "communication_data_type", "seq_parallel_communication_data_type", "elasticity", "pipeline",
    "data_types", "data_efficiency", "curriculum_learning", "compression_training", "checkpoint", "autotuning",
    "nebula", "sparse_attention", "disable_allgather", "fp32_allreduce", "eigenvalue", "progressive_layer_drop",
    "quantize_training", "dataloader_drop_last", "mics_shard_size", "mics_hierarchical_params_gather",
    "weight_quantization", "hybrid_engine", "tensor_parallel", "compile", "timers", "graph_harvesting",
    "use_data_before_expert_parallelism", "gradient_allreduce_op", "expert_parallel", "log_level",
    "managed_gradient_accumulation", "disable_python_gc", "vocabulary_size", "zenflow", "sequence_parallel_size",
}

EXPERT_OWNERS = {"enabled": "parallel.expert > 1", "autoep_size": "parallel.expert",
                 "preset_model": "the model type's AutoEP preset"}

# Keys the trainer owns: template key path -> (run-config key, resolved value getter).
def _owned(cfg: RunConfig, plan: BatchPlan, dtype: str) -> dict[tuple, tuple[str, Any]]:
    return {
        ("train_batch_size",): ("train.global_batch_size", plan.global_batch_size),
        ("train_micro_batch_size_per_gpu",): ("train.micro_batch_size", plan.micro_batch_size),
        ("gradient_accumulation_steps",): ("global / (micro x data-parallel size)", plan.grad_accum_steps),
        ("gradient_clipping",): ("train.grad_clip", cfg.train.grad_clip),
        ("bf16", "enabled"): (f"model.dtype ({dtype})", dtype == "bf16"),
        ("fp16", "enabled"): (f"model.dtype ({dtype})", dtype == "fp16"),
        ("tensor_parallel", "autotp_size"): ("parallel.tensor", cfg.parallel.tensor),
        # The trainer sums the loss over full-vocabulary logits (tiled, token-weighted across ranks);
        # a vocabulary-parallel head (DeepSpeed's default for a tied one) hands it a shard of them.
        ("tensor_parallel", "vocab_parallel_lm_head"): ("ds_train's loss (full-vocabulary logits)", False),
    }


def _get(d: dict, path: tuple):
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def _resolve(d: dict, path: tuple, value: Any, owner: str, source: str) -> None:
    """Fill an "auto" (or a missing trainer-owned key); an explicit value must agree."""
    current = _get(d, path)
    dotted = ".".join(path)
    if current is None or current == AUTO:
        node = d
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    elif current != value and not (isinstance(value, float) and isinstance(current, (int, float))
                                   and abs(current - value) <= 1e-12 * max(1.0, abs(value))):
        raise UserError(f"{source}: {dotted}={current!r} contradicts {owner}={value!r}; "
                        f"set it to \"auto\" or make them agree")


def _check_unknown_keys(ds: dict, source: str) -> None:
    unknown = [k for k in ds if k not in KNOWN_TOP_LEVEL and not k.startswith("_")]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, KNOWN_TOP_LEVEL, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"{source}: unknown DeepSpeed key {key!r}{hint}; DeepSpeed would ignore it")


def _check_sections(ds: dict, source: str) -> None:
    """Nested keys through DeepSpeed's own pydantic models, which forbid extra fields; the scheduler
    through its class's arguments and the schedule numbers' declared bounds; an Adam's params through
    the arguments of the class DeepSpeed builds."""
    check_scheduler(ds, source)
    check_optimizer(ds, source)
    import pydantic
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig

    for key, model in (("zero_optimization", DeepSpeedZeroConfig), ("bf16", DeepSpeedBF16Config),
                       ("fp16", DeepSpeedFP16Config), ("tensor_parallel", TPTrainingConfig)):
        if key not in ds:
            continue
        try:
            model(**ds[key])
        except pydantic.ValidationError as e:
            err = e.errors()[0]
            where = ".".join([key, *map(str, err["loc"])])
            what = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            raise UserError(f"{source}: {where}: {what}; DeepSpeed would ignore or reject it") from None


def render_ds_config(template: dict, cfg: RunConfig, plan: BatchPlan, *, dtype: str, hidden_size: int, lr: float,
                     total_steps: int, on_gpu: bool, experts: dict | None = None, source: str = "ds_config") -> dict:
    """Template + run config + batch plan -> the complete ds_config handed to deepspeed.initialize.

    `lr` is the scaled peak learning rate, `total_steps` the optimizer steps the schedule spans, `experts`
    the expert_parallel section of parallel.expert (plan/experts.py).
    Rendered once per start, before the ranks meet; what they agree on adds its checkpoint options
    (with_checkpoint_options). Nothing else patches the result.
    """
    ds = copy.deepcopy(template)
    _check_unknown_keys(ds, source)
    for path, (owner, value) in _owned(cfg, plan, dtype).items():
        if path[0] not in ds and (path[0] in ("bf16", "fp16") and not value or path[0] == "tensor_parallel"
                                  and cfg.parallel.tensor == 1):
            continue  # a section the run does not use stays out
        _resolve(ds, path, value, owner, source)
    for key, value in (experts or {}).items():
        _resolve(ds, ("expert_parallel", key), value, EXPERT_OWNERS[key], source)
    if not experts and _get(ds, ("expert_parallel", "enabled")):
        raise UserError(f"{source}: expert_parallel.enabled=true, but parallel.expert=1; set parallel.expert "
                        f"instead (ds_train renders the section)")
    if ds.get("bf16", {}).get("enabled") and ds.get("fp16", {}).get("enabled"):
        raise UserError(f"{source}: bf16 and fp16 are both enabled; set model.dtype instead")
    zero = ds["zero_optimization"] = resolve_zero(ds.get("zero_optimization", {"stage": 0}), hidden_size)
    offload = _get(zero, ("offload_optimizer", "device")) in ("cpu", "nvme")
    if "optimizer" in ds:
        params = ds["optimizer"].setdefault("params", {})
        o = cfg.optim
        for key, owner, value in (("lr", "optim.lr (scaled)", lr), ("betas", "optim.betas", list(o.betas)),
                                  ("eps", "optim.eps", o.eps), ("weight_decay", "optim.weight_decay",
                                                                o.weight_decay)):
            _resolve(params, (key,), value, owner, source + ": optimizer.params")
        if params.get("torch_adam") == AUTO:  # torch's AdamW: no op to build; CPU offload keeps DeepSpeedCPUAdam
            params["torch_adam"] = not offload
            if on_gpu and not offload:
                params.setdefault("fused", True)  # one CUDA kernel per group, like FusedAdam, built into torch
    if "scheduler" in ds:
        schedule_class(ds["scheduler"], source)
        params = ds["scheduler"].setdefault("params", {})
        sched = ds["scheduler"].get("type")
        # The warm-up's step 0 (the first update, start_schedule) trains at 1/(warmup_steps + 1) of the
        # peak, update k of the warm-up at k/(warmup_steps + 1), as torchtitan's linear warm-up: never at 0.
        warmup = cfg.optim.warmup_steps
        values = {"total_num_steps": total_steps, "warmup_num_steps": max(1, warmup),
                  "warmup_min_ratio": 1 / (warmup + 1), "cos_min_ratio": cfg.optim.min_lr_ratio,
                  "warmup_max_lr": lr, "warmup_min_lr": lr / (warmup + 1)}
        for key, value in values.items():
            if params.get(key) == AUTO:
                params[key] = value
        leftover = [k for k, v in params.items() if v == AUTO]
        if leftover:
            raise UserError(f"{source}: scheduler {sched!r} param {leftover[0]!r} is \"auto\" but "
                            f"ds_train cannot derive it; give a value")
    leftover = [k for k, v in zero.items() if v == AUTO]
    if leftover:
        raise UserError(f"{source}: zero_optimization.{leftover[0]} is \"auto\" but ds_train cannot "
                        f"derive it; give a value")
    _check_sections(ds, source)
    check_autoep_section(ds, plan.data_parallel_size * cfg.parallel.sequence * cfg.parallel.tensor, source)
    return ds


def with_checkpoint_options(ds: dict, *, load_universal: bool, node_local: bool) -> dict:
    """The rendered ds_config with what the ranks agreed on at start-up: `load_universal` when the
    resume loads a universal checkpoint, `node_local` when each node's first rank writes the model
    states on its own disk (DeepSpeed's checkpoint section)."""
    options = {"load_universal": True} if load_universal else {}
    options |= {"use_node_local_storage": True} if node_local else {}
    return {**ds, "checkpoint": {**ds.get("checkpoint", {}), **options}} if options else ds


ARCH_ENTRY = re.compile(r"^(\d+)\.(\d+)[a-z]?(\+PTX)?$")


def deepspeed_arch_list(value: str | None) -> str | None:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed 0.19.8's op builder parses it, or None when it needs no
    change: it reads an entry as major.minor[+PTX], so torch's arch-specific targets ('9.0a', '10.0f',
    set by CUDA images) fail its build with "invalid literal for int() ... '0a'". Such an entry loses
    its suffix: DeepSpeed's ops then build for the plain architecture (sm_90), which runs there."""
    if not value or not value.strip():
        return None
    out = []
    for entry in value.replace(" ", ";").split(";"):
        m = ARCH_ENTRY.match(entry.strip())
        plain = f"{m.group(1)}.{m.group(2)}{m.group(3) or ''}" if m else entry.strip()
        if plain and plain not in out:
            out.append(plain)
    fixed = ";".join(out)
    return None if fixed == value.strip() else fixed


def fix_arch_list(ds_config: dict) -> str | None:
    """When `ds_config` builds a DeepSpeed op, TORCH_CUDA_ARCH_LIST as its builder parses it (in this
    process's environment); what was changed, to say, or None."""
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not builds_deepspeed_op(ds_config) or not (fixed := deepspeed_arch_list(arch)):
        return None
    os.environ["TORCH_CUDA_ARCH_LIST"] = fixed
    return f"TORCH_CUDA_ARCH_LIST={arch} -> {fixed} for DeepSpeed's op build (it cannot parse arch-specific entries)"


def builds_deepspeed_op(ds_config: dict) -> bool:
    """Whether the rendered optimizer is one of DeepSpeed's own (JIT-built on first use: FusedAdam,
    DeepSpeedCPUAdam under offload, FusedLamb, FusedLion...) rather than torch's."""
    opt = ds_config.get("optimizer")
    if not isinstance(opt, dict):
        return False
    return not (str(opt.get("type", "")).lower() in ("adam", "adamw") and opt.get("params", {}).get("torch_adam"))


# The op DeepSpeed JIT-builds for an optimizer it builds itself, by (type, optimizer offloaded): its
# op builder's NAME (deepspeed/ops/op_builder/*.py), also the torch-extension directory it lands in.
OPS = {("adam", False): "fused_adam", ("adamw", False): "fused_adam", ("lamb", False): "fused_lamb",
       ("lion", False): "fused_lion", ("adam", True): "cpu_adam", ("adamw", True): "cpu_adam",
       ("lion", True): "cpu_lion", ("adagrad", True): "cpu_adagrad"}


def op_to_build(ds_config: dict) -> str | None:
    """The DeepSpeed op a rendered ds_config's optimizer needs on a CUDA host, or None (torch's)."""
    if not builds_deepspeed_op(ds_config):
        return None
    offload = _get(ds_config.get("zero_optimization", {}), ("offload_optimizer", "device")) in ("cpu", "nvme")
    return OPS.get((str(ds_config["optimizer"].get("type", "")).lower(), offload))


def op_build_problem(op: str, *, cuda_home: str | None, nvcc_cuda: str | None, torch_cuda: str | None,
                     ninja: bool, cxx: bool, arch_list: str | None, cached: bool = False) -> str | None:
    """What keeps DeepSpeed from building `op` on this host, in one line with the fix; None if nothing.
    Every op needs ninja and a C++ compiler; a CUDA op (fused_*) also nvcc of torch's CUDA major
    version and an arch list DeepSpeed parses. The CPU ones (offload) are plain C++ on a CUDA host
    too (DeepSpeed's CUDA accelerator takes them from op_builder/cpu).

    `cached`: the op was JIT-built before in this torch-extensions directory. Loading it still goes
    through torch's cpp_extension.load, which in a new process always writes build.ninja again and
    runs ninja (which then finds nothing to do): DeepSpeed's jit_load and torch's loader ask for ninja;
    for a CUDA op torch's _prepare_ldflags joins CUDA_HOME (OSError "CUDA_HOME environment variable is
    not set" without it) and both DeepSpeed's compute_capability_args and torch's _get_cuda_arch_flags
    parse the arch list. Neither runs nvcc nor the compiler then (torch only warns about a missing one)."""
    lacks = []
    if not ninja:
        lacks.append("ninja (pip install ninja)")
    if not cxx and not cached:
        lacks.append("a C++ compiler (c++, or $CXX)")
    if op.startswith("fused"):
        if cuda_home is None:
            lacks.append("the CUDA toolkit (no nvcc on PATH, CUDA_HOME unset)")
        elif not cached and nvcc_cuda is None:
            lacks.append(f"nvcc under CUDA_HOME={cuda_home}")
        elif not cached and torch_cuda and nvcc_cuda.split(".")[0] != torch_cuda.split(".")[0]:
            lacks.append(f"nvcc of torch's CUDA {torch_cuda} (CUDA_HOME={cuda_home} has {nvcc_cuda})")
        bad = [e for e in (arch_list or "").replace(" ", ";").split(";")
               if e.strip() and not ARCH_ENTRY.match(e.strip())]
        if bad:
            lacks.append(f"TORCH_CUDA_ARCH_LIST entries as major.minor, like 9.0 (not {bad[0]!r})")
    if not lacks:
        return None
    how = ("built before in the torch-extensions directory, and loading it there still needs what torch's loader "
           "asks for; this host lacks" if cached else "compiled on first use, and this host lacks")
    return (f"the ds_config's optimizer needs DeepSpeed's {op} op, {how} "
            f"{'; '.join(lacks)}: install it, or let torch's AdamW run (optimizer.params.torch_adam \"auto\", "
            f"as ds_configs/zero*.json have it)")


def _jit_built(op: str) -> bool:
    """Whether `op` was JIT-built before in this torch-extensions directory (then it loads without a
    compiler)."""
    from torch.utils import cpp_extension

    with contextlib.suppress(AttributeError, OSError):
        return (Path(cpp_extension._get_build_directory(op, verbose=False)) / f"{op}.so").is_file()
    return False


def _nvcc_cuda(home: str) -> str | None:
    """The CUDA release of `home`/bin/nvcc ("12.4"), None when it does not run."""
    import subprocess

    with contextlib.suppress(OSError, subprocess.SubprocessError):
        said = subprocess.run([str(Path(home) / "bin" / "nvcc"), "--version"], capture_output=True, text=True,
                              timeout=60).stdout
        m = re.search(r"release (\d+\.\d+)", said)
        return m.group(1) if m else None
    return None


def check_op_build(ds_config: dict) -> None:
    """Before deepspeed.initialize on a CUDA host: a DeepSpeed op the optimizer needs, not prebuilt,
    must be buildable here, or (in the JIT cache) loadable; otherwise one line (UserError) says what
    is missing."""
    op = op_to_build(ds_config)
    if op is None:
        return
    import torch
    from deepspeed.git_version_info import installed_ops
    from torch.utils import cpp_extension

    if installed_ops.get(op):  # prebuilt into the wheel: imported, no JIT load
        return
    cached = _jit_built(op)
    home = cpp_extension.CUDA_HOME
    nvcc_cuda = _nvcc_cuda(home) if home and op.startswith("fused") and not cached else None
    problem = op_build_problem(op, cuda_home=home, nvcc_cuda=nvcc_cuda, torch_cuda=torch.version.cuda,
                               ninja=cpp_extension.is_ninja_available(),
                               cxx=shutil.which(os.environ.get("CXX", "c++")) is not None,
                               arch_list=os.environ.get("TORCH_CUDA_ARCH_LIST"), cached=cached)
    if problem:
        raise UserError(problem)


def zero_stage(ds_config: dict) -> int:
    """The stage a template or rendered config asks for (an engine: engine.zero_optimization_stage())."""
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def initialize(model, ds_config: dict, mpu=None):
    """deepspeed.initialize with the optimizer and scheduler the ds_config names (`mpu`: the
    parallel groups of Ulysses sequence parallelism, ds_train/model/ulysses.py). Under AutoTP the
    groups are DeepSpeed's own (data x tensor, tensor innermost), made first and handed in, so that
    DeepSpeed checks train_batch_size against the data-parallel size rather than the world."""
    import deepspeed

    tp = int((ds_config.get("tensor_parallel") or {}).get("autotp_size", 0) or 0)
    if tp > 1 and mpu is None:
        mpu = dist.tensor_parallel_groups(tp)

    defer_muon_compile()
    params = [p for p in model.parameters() if p.requires_grad]
    with output_capture_registry_takes_keys(bool(ds_config.get("expert_parallel", {}).get("enabled"))):
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config, mpu=mpu)
    undo_init_step(engine.optimizer)
    start_schedule(engine.lr_scheduler)
    return engine


def start_schedule(scheduler) -> bool:
    """DeepSpeed's schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) begin
    at iteration -1, whose learning rate is 0, and step after each update: the first update trained
    at lr 0, and under WarmupCosineLR's linear warm-up (0 at its step 0) the second as well. Stepped
    once here, before any update, so the first update trains at the schedule's step 0 (with the
    warm-up floor render_ds_config derives: 1/(warmup_steps + 1) of the peak). A resumed run then
    loads the schedule's saved iteration over this one. True when it stepped."""
    if getattr(scheduler, "last_batch_iteration", None) != -1:
        return False
    scheduler.step()
    return True


def undo_init_step(optimizer) -> bool:
    """DeepSpeed 0.19.8's ZeRO-0 bf16/fp16 optimizers (FP16_UnfusedOptimizer, FP16_Optimizer) create
    their inner optimizer's state by stepping it once with zero gradients. With AdamW that step decays
    every fp32 master weight by lr x weight_decay and starts Adam's step count at 1, so every later
    update takes the bias correction of the step after (measured: a bf16 ZeRO-0 run 1.7% off the fp32
    reference after 8 steps, ZeRO 1-3 0.02%). Undone here: the masters are the model's weights again and
    the state is empty, as before a first step. True when there was such a step to undo."""
    import torch

    inner = getattr(optimizer, "optimizer", None)
    if type(optimizer).__name__ not in ("FP16_UnfusedOptimizer", "FP16_Optimizer") or inner is None:
        return False
    with torch.no_grad():
        if hasattr(optimizer, "fp32_groups_flat"):  # the fused one: one flat master per group
            for master, params in zip(optimizer.fp32_groups_flat, optimizer.fp16_groups):
                master.copy_(torch.cat([p.detach().reshape(-1).float() for p in params]))
        else:
            for masters, params in zip(optimizer.fp32_groups, optimizer.fp16_groups):
                for master, p in zip(masters, params):
                    master.copy_(p.detach().float())
    inner.state.clear()
    return True
