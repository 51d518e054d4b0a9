"""ds_train.engine: ds_configs/*.json + run config + batch plan -> the final ds_config (no process group)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ds_train.config.file import build_config
from ds_train.dsconfig import read_ds_template
from ds_train.engine import render_ds_config, with_checkpoint_options, zero_stage
from ds_train.errors import UserError
from ds_train.plan.batch import plan_batch

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = sorted((ROOT / "ds_configs").glob("*.json"))
HIDDEN = 64
LR = 1.5e-3


def make_cfg(**sections):
    raw = {"model": {"config": {"model_type": "llama", "hidden_size": HIDDEN}},
           "train": {"global_batch_size": 32, "micro_batch_size": 4, "max_steps": 50, "grad_clip": 1.0},
           "optim": {"lr": 1e-3, "warmup_steps": 5, "min_lr_ratio": 0.2, "betas": [0.9, 0.99],
                     "eps": 1e-7, "weight_decay": 0.05}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return build_config(raw)


CFG = make_cfg()
PLAN = plan_batch(32, 4, 2, 128)  # accum 4


def render(template, dtype="bf16", on_gpu=False, cfg=CFG, plan=PLAN, hidden=HIDDEN, lr=LR, total_steps=50):
    return render_ds_config(template, cfg, plan, dtype=dtype, hidden_size=hidden, lr=lr, total_steps=total_steps,
                            on_gpu=on_gpu, source="t.json")


def strings(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from strings(v)
    elif isinstance(node, str):
        yield node


def test_the_templates_exist():
    names = {p.stem for p in TEMPLATES}
    assert {"zero0", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"} <= names


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_every_template_renders_without_auto(path, dtype):
    template = read_ds_template(path)
    ds = render(template, dtype)
    assert "auto" not in list(strings(ds))
    assert "auto" not in json.dumps(ds)
    assert ds["train_batch_size"] == (ds["train_micro_batch_size_per_gpu"]
                                      * ds["gradient_accumulation_steps"] * PLAN.data_parallel_size)
    assert ds["train_batch_size"] == 32
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 1.0
    assert ds["bf16"]["enabled"] is (dtype == "bf16")
    assert ds["fp16"]["enabled"] is (dtype == "fp16")
    assert template == read_ds_template(path)  # the template itself is not mutated
    assert zero_stage(ds) == template["zero_optimization"]["stage"]


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
def test_optimizer_and_scheduler_come_from_the_run_config(path):
    ds = render(read_ds_template(path))
    params = ds["optimizer"]["params"]
    assert params["lr"] == LR  # the (scaled) lr argument, not optim.lr
    assert params["betas"] == [0.9, 0.99]
    assert params["eps"] == 1e-7
    assert params["weight_decay"] == 0.05
    sched = ds["scheduler"]["params"]
    assert sched["total_num_steps"] == 50
    assert sched["warmup_num_steps"] == 5
    assert sched["cos_min_ratio"] == 0.2


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
def test_optimizer_needs_no_op_build_unless_offloaded(path):
    """torch's AdamW (fused on a GPU) wherever it can run: nothing to JIT-compile; CPU offload keeps
    DeepSpeedCPUAdam, which DeepSpeed builds."""
    offload = path.stem.endswith("_offload")
    on_cpu = render(read_ds_template(path), on_gpu=False)["optimizer"]["params"]
    on_gpu = render(read_ds_template(path), on_gpu=True)["optimizer"]["params"]
    assert on_cpu["torch_adam"] is on_gpu["torch_adam"] is (not offload)
    assert "fused" not in on_cpu
    assert on_gpu.get("fused") is (True if not offload else None)


@pytest.mark.parametrize("name", ["zero3", "zero3_offload"])
@pytest.mark.parametrize("hidden", [64, 100, 4096])
def test_zero3_buckets_from_hidden_size(name, hidden):
    ds = render(read_ds_template(ROOT / "ds_configs" / f"{name}.json"), hidden=hidden)
    zero = ds["zero_optimization"]
    assert zero["reduce_bucket_size"] == hidden * hidden
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * hidden * hidden)
    assert zero["stage3_param_persistence_threshold"] == 10 * hidden


def test_explicit_bucket_sizes_are_kept():
    ds = render(read_ds_template(ROOT / "ds_configs" / "zero2.json"))
    assert ds["zero_optimization"]["reduce_bucket_size"] == 200_000_000


def test_fp32_leaves_missing_precision_sections_out():
    ds = render({}, dtype="fp32")
    assert "bf16" not in ds and "fp16" not in ds
    assert ds["train_batch_size"] == 32 and ds["zero_optimization"] == {"stage": 0}


def test_missing_trainer_owned_keys_are_filled():
    ds = render({"zero_optimization": {"stage": 1}}, dtype="bf16")
    assert ds["bf16"] == {"enabled": True}
    assert ds["gradient_accumulation_steps"] == 4


# --- contradictions ------------------------------------------------------------------------------

def test_explicit_train_batch_size_that_disagrees_names_both():
    with pytest.raises(UserError) as e:
        render({"train_batch_size": 64})
    msg = str(e.value)
    assert "t.json" in msg
    assert "train_batch_size=64" in msg
    assert "train.global_batch_size=32" in msg


def test_explicit_gradient_clipping_that_disagrees_names_both():
    with pytest.raises(UserError) as e:
        render({"gradient_clipping": 0.5})
    msg = str(e.value)
    assert "gradient_clipping=0.5" in msg
    assert "train.grad_clip=1.0" in msg


def test_explicit_values_that_agree_are_accepted():
    ds = render({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                 "gradient_accumulation_steps": 4, "gradient_clipping": 1})
    assert ds["train_batch_size"] == 32 and ds["gradient_clipping"] == 1


def test_explicit_micro_batch_that_disagrees():
    with pytest.raises(UserError, match=r"train_micro_batch_size_per_gpu=8 .*train\.micro_batch_size=4"):
        render({"train_micro_batch_size_per_gpu": 8})


def test_explicit_optimizer_lr_that_disagrees():
    template = {"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}
    with pytest.raises(UserError) as e:
        render(template)
    assert "lr=0.1" in str(e.value) and str(LR) in str(e.value)


def test_explicit_bf16_with_fp16_dtype_is_rejected():
    with pytest.raises(UserError, match="bf16"):
        render({"bf16": {"enabled": True}}, dtype="fp16")


# --- unknown keys --------------------------------------------------------------------------------

def test_unknown_top_level_key_suggests_the_closest():
    with pytest.raises(UserError) as e:
        render({"zero_optimisation": {"stage": 2}})
    msg = str(e.value)
    assert "'zero_optimisation'" in msg
    assert "'zero_optimization'" in msg


def test_unknown_nested_zero_key_is_named_with_its_path():
    with pytest.raises(UserError) as e:
        render({"zero_optimization": {"stage": 2, "overlap_com": True}})
    assert "zero_optimization.overlap_com" in str(e.value)
    assert "unknown key" in str(e.value)


def test_unknown_nested_precision_key():
    with pytest.raises(UserError, match=r"fp16\.loss_scal"):
        render({"fp16": {"enabled": "auto", "loss_scal": 0}}, dtype="fp16")


def test_zero_auto_that_cannot_be_derived():
    with pytest.raises(UserError, match="zero_optimization.allgather_bucket_size"):
        render({"zero_optimization": {"stage": 2, "allgather_bucket_size": "auto"}})


def test_scheduler_auto_that_cannot_be_derived():
    template = {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto",
                                                             "warmup_type": "auto"}}}
    with pytest.raises(UserError, match="'warmup_type'"):
        render(template)


def test_underscore_keys_are_comments():
    ds = render({"_comment": "stage 0 for debugging"})
    assert ds["_comment"] == "stage 0 for debugging"


# --- reading the template ------------------------------------------------------------------------

def test_invalid_json_reports_the_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": "auto",\n  "zero_optimization": {"stage": 2,}\n}\n')
    with pytest.raises(UserError) as e:
        read_ds_template(path)
    assert str(path) in str(e.value)
    assert "line 3" in str(e.value)


def test_missing_template_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="not found"):
        read_ds_template(tmp_path / "zero9.json")


def test_template_must_be_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(UserError, match="JSON object"):
        read_ds_template(path)


def test_a_directory_given_as_the_template_says_so(tmp_path):
    with pytest.raises(UserError) as e:
        read_ds_template(tmp_path)
    assert str(e.value) == (f"--ds-config: '{tmp_path}' is a directory, not a DeepSpeed JSON file; give the "
                            f"file itself")


def test_a_template_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{\n  "_comment": "caf\xe9"\n}')
    with pytest.raises(UserError) as e:
        read_ds_template(path)
    assert str(e.value) == f"{path}: not UTF-8 text (byte 0xe9 on line 2); save the DeepSpeed JSON file as UTF-8"


def test_schedule_length_is_an_argument_and_the_agreed_checkpoint_options_keep_the_template_s_keys():
    """RIPT's schedule spans its optimizer steps, not train.max_steps; a resume through a universal
    checkpoint and node-local storage add DeepSpeed's options to the rendered config, keeping the
    template's own checkpoint keys and leaving the rendered dict as it was."""
    template = read_ds_template(ROOT / "ds_configs" / "zero2.json")
    ds = render({**template, "checkpoint": {"tag_validation": "Warn"}}, total_steps=120)
    assert ds["scheduler"]["params"]["total_num_steps"] == 120
    both = with_checkpoint_options(ds, load_universal=True, node_local=True)
    assert both["checkpoint"] == {"tag_validation": "Warn", "load_universal": True, "use_node_local_storage": True}
    assert ds["checkpoint"] == {"tag_validation": "Warn"}
    assert with_checkpoint_options(ds, load_universal=False, node_local=False) is ds
    plain = render(template)
    assert "checkpoint" not in plain
    assert with_checkpoint_options(plain, load_universal=True, node_local=False)["checkpoint"] == {
        "load_universal": True}


@pytest.mark.parametrize("given, fixed", [("9.0a", "9.0"), ("8.0;9.0a", "8.0;9.0"), ("9.0 10.0f+PTX", "9.0;10.0+PTX"),
                                          ("9.0", None), ("8.0;9.0+PTX", None), ("", None), (None, None)])
def test_an_arch_list_deepspeed_cannot_parse_is_made_one_its_real_builder_parses(given, fixed, monkeypatch):
    """Through DeepSpeed's own FusedAdam builder (the failure of the first GPU lease: the image's
    TORCH_CUDA_ARCH_LIST=9.0a): the list as given fails it, the list ds_train hands it parses."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    from ds_train.engine import deepspeed_arch_list

    assert deepspeed_arch_list(given) == fixed

    def parse(value):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
        builder = FusedAdamBuilder()
        builder.jit_mode = True
        builder.compute_capability_args()

    if fixed:
        with pytest.raises(ValueError, match="invalid literal for int"):
            parse(given)
        parse(fixed)
    elif given:
        parse(given)


def test_only_deepspeeds_own_optimizers_build_an_op(monkeypatch):
    from ds_train.engine import builds_deepspeed_op

    for path in TEMPLATES:
        rendered = render(read_ds_template(path), on_gpu=True)
        assert builds_deepspeed_op(rendered) is path.stem.endswith("_offload"), path.stem
    fused = render({**read_ds_template(TEMPLATES[0]), "optimizer": {"type": "AdamW", "params": {"torch_adam": False}}},
                   on_gpu=True)
    assert builds_deepspeed_op(fused) and not builds_deepspeed_op({})
    from ds_train.engine import fix_arch_list

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    assert fix_arch_list(render(read_ds_template(TEMPLATES[0]), on_gpu=True)) is None  # torch's AdamW: as it was
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0a"
    assert fix_arch_list(fused) == ("TORCH_CUDA_ARCH_LIST=8.0;9.0a -> 8.0;9.0 for DeepSpeed's op build (it "
                                    "cannot parse arch-specific entries)")
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0"


def test_the_op_an_optimizer_needs_and_what_keeps_it_from_being_built_are_one_line():
    from ds_train.engine import check_op_build, op_build_problem, op_to_build

    assert [op_to_build(render(read_ds_template(p), on_gpu=True)) for p in TEMPLATES] == \
        [("cpu_adam" if p.stem.endswith("_offload") else None) for p in TEMPLATES]
    fused = render({**read_ds_template(TEMPLATES[0]), "optimizer": {"type": "AdamW", "params": {"torch_adam": False}}},
                   on_gpu=True)
    assert op_to_build(fused) == "fused_adam"
    ok = dict(cuda_home="/usr/local/cuda", nvcc_cuda="13.0", torch_cuda="13.0", ninja=True, cxx=True, arch_list="9.0")
    assert op_build_problem("fused_adam", **ok) is None
    assert op_build_problem("fused_adam", **{**ok, "arch_list": "8.0;9.0a"}) is None  # ds_train rewrites 9.0a
    for change, said in [
            ({"cuda_home": None, "nvcc_cuda": None}, "the CUDA toolkit (no nvcc on PATH, CUDA_HOME unset)"),
            ({"nvcc_cuda": None}, "nvcc under CUDA_HOME=/usr/local/cuda"),
            ({"nvcc_cuda": "12.4"}, "nvcc of torch's CUDA 13.0 (CUDA_HOME=/usr/local/cuda has 12.4)"),
            ({"ninja": False}, "ninja (pip install ninja)"),
            ({"cxx": False}, "a C++ compiler (c++, or $CXX)"),
            ({"arch_list": "sm_90"}, "TORCH_CUDA_ARCH_LIST entries as major.minor, like 9.0 (not 'sm_90')")]:
        line = op_build_problem("fused_adam", **{**ok, **change})
        assert line.startswith("the ds_config's optimizer needs DeepSpeed's fused_adam op") and said in line, line
        assert "\n" not in line
        assert line.endswith('(optimizer.params.torch_adam "auto", as ds_configs/zero*.json have it)')
    # the offload ops are plain C++ on a CUDA host too: no toolkit needed
    assert op_build_problem("cpu_adam", **{**ok, "cuda_home": None, "nvcc_cuda": None, "arch_list": "sm_90"}) is None
    assert "ninja" in op_build_problem("cpu_adam", **{**ok, "ninja": False})
    # this host, for real: no CUDA toolkit (torch's own CUDA_HOME finds none), and the op never built here
    with pytest.raises(UserError, match=r"needs DeepSpeed's fused_adam op, .* lacks the CUDA toolkit"):
        check_op_build(fused)
    check_op_build(render(read_ds_template(TEMPLATES[0]), on_gpu=True))  # torch's AdamW: nothing to build


def test_an_op_in_the_jit_cache_still_needs_what_torchs_loader_asks_for(tmp_path, monkeypatch):
    """torch's cpp_extension.load writes build.ninja again in every new process: ninja, CUDA_HOME
    (joined into the link flags) and a parseable arch list are needed for a cached CUDA op too, nvcc
    and the compiler are not. The cache faked here (TORCH_EXTENSIONS_DIR holding fused_adam.so); this
    host's torch finds no CUDA_HOME, as a GPU host without a toolkit: one line, not a traceback."""
    from ds_train.engine import check_op_build, op_build_problem

    ok = dict(cuda_home="/usr/local/cuda", nvcc_cuda=None, torch_cuda="13.0", ninja=False, cxx=False,
              arch_list="9.0", cached=True)
    line = op_build_problem("fused_adam", **ok)
    assert "built before in the torch-extensions directory" in line and line.endswith(
        'lacks ninja (pip install ninja): install it, or let torch\'s AdamW run (optimizer.params.torch_adam '
        '"auto", as ds_configs/zero*.json have it)')  # no nvcc, no compiler: not asked for
    assert op_build_problem("fused_adam", **{**ok, "ninja": True}) is None
    assert "12.4" not in (op_build_problem("fused_adam", **{**ok, "ninja": True, "nvcc_cuda": "12.4"}) or "")
    for change, said in [({"cuda_home": None}, "the CUDA toolkit (no nvcc on PATH, CUDA_HOME unset)"),
                         ({"arch_list": "sm_90"}, "TORCH_CUDA_ARCH_LIST entries as major.minor")]:
        assert said in op_build_problem("fused_adam", **{**ok, "ninja": True, **change})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "fused_adam").mkdir()
    (tmp_path / "fused_adam" / "fused_adam.so").write_bytes(b"")
    fused = render({**read_ds_template(TEMPLATES[0]), "optimizer": {"type": "AdamW", "params": {"torch_adam": False}}},
                   on_gpu=True)
    with pytest.raises(UserError, match=r"fused_adam op, built before in the torch-extensions directory, .* "
                                        r"lacks the CUDA toolkit \(no nvcc on PATH, CUDA_HOME unset\)"):
        check_op_build(fused)


UNDO_PROBE = """
import json, os, sys, torch, deepspeed
from ds_train import dist, topology
from ds_train.engine import initialize
dist.init(topology.detect_env())
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
ds = {"train_batch_size": 1, "bf16": {"enabled": True}, "gradient_clipping": 1.0, "zero_optimization": {"stage": 0},
      "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1, "torch_adam": True}},
      "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 4,
                                                         "warmup_min_ratio": 0.2, "warmup_type": "linear"}}}
engine = initialize(model, ds)
opt = engine.optimizer
masters = [m for group in opt.fp32_groups for m in group]
params = [p for group in opt.fp16_groups for p in group]
state, equal = len(opt.optimizer.state), all(torch.equal(m, p.float()) for m, p in zip(masters, params))
lrs = [engine.get_lr()[0]]
for _ in range(2):  # real updates: the lr each one trains at is the optimizer's when it steps
    engine.backward(engine(torch.randn(1, 8, dtype=torch.bfloat16)).float().sum())
    engine.step()
    lrs.append(engine.get_lr()[0])
print(json.dumps({"kind": type(opt).__name__, "state": state, "equal": equal, "lrs": lrs}))
"""


@pytest.mark.slow
def test_zero0_low_precision_optimizer_starts_as_before_a_first_step(tmp_path):
    """DeepSpeed 0.19.8's ZeRO-0 bf16 optimizer steps AdamW once with zero gradients when it is built
    (weight decay on every master weight, Adam's step count at 1): ds_train's initialize undoes it. And
    it starts the schedule: the first update trains at the warm-up's floor, not 0. One process, the real
    engine."""
    import subprocess
    import sys

    from conftest import free_port

    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", UNDO_PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    lrs = got.pop("lrs")
    assert got == {"kind": "FP16_UnfusedOptimizer", "state": 0, "equal": True}, got
    assert lrs == pytest.approx([0.002, 0.004, 0.006], rel=1e-9)  # the engine's schedule, started: 1/5, 2/5, 3/5


def lr_per_update(ds: dict, updates: int) -> list[float]:
    """The learning rate each update trains at, under DeepSpeed's own scheduler class built from the
    rendered section as its engine builds it, started as ds_train.engine.initialize starts it."""
    import torch
    from deepspeed.runtime import lr_schedules

    from ds_train.engine import start_schedule

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=ds["optimizer"]["params"]["lr"])
    sched = getattr(lr_schedules, ds["scheduler"]["type"])(opt, **ds["scheduler"]["params"])
    assert start_schedule(sched) and not start_schedule(sched)  # once: a resumed schedule is not stepped again
    lrs = []
    for _ in range(updates):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()  # after each update, as DeepSpeed's engine.step does
    return lrs


@pytest.mark.parametrize("kind", ["WarmupCosineLR", "WarmupDecayLR", "WarmupLR"])
def test_the_first_update_trains_at_a_non_zero_learning_rate(kind):
    """DeepSpeed's schedules start at a learning rate of 0 (WarmupCosineLR's linear warm-up: the first two
    updates). Started once before the first update, update k of a 4-step warm-up trains at k/5 of the
    peak and the peak follows. The last update: WarmupCosineLR's at min_lr_ratio, WarmupDecayLR's 1/16 of
    the way above its warmup_min_lr (the warm-up's floor, where DeepSpeed's linear decay ends one update
    later), WarmupLR's at the peak."""
    params = {"WarmupCosineLR": {"total_num_steps": "auto", "warmup_num_steps": "auto", "warmup_min_ratio": "auto",
                                 "cos_min_ratio": "auto", "warmup_type": "linear"},
              "WarmupDecayLR": {"total_num_steps": "auto", "warmup_num_steps": "auto", "warmup_min_lr": "auto",
                                "warmup_max_lr": "auto", "warmup_type": "linear"},
              "WarmupLR": {"warmup_num_steps": "auto", "warmup_min_lr": "auto", "warmup_max_lr": "auto",
                           "warmup_type": "linear"}}[kind]
    template = {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "scheduler": {"type": kind, "params": params}}
    lrs = lr_per_update(render(template, cfg=make_cfg(optim={"warmup_steps": 4}), total_steps=20), 20)
    assert lrs[:4] == pytest.approx([LR * k / 5 for k in range(1, 5)], rel=1e-9)
    assert lrs[4] == pytest.approx(LR, rel=2e-2) and max(lrs) <= LR
    assert lrs[-1] == pytest.approx({"WarmupCosineLR": 0.2 * LR, "WarmupDecayLR": LR / 5 + (LR - LR / 5) / 16,
                                     "WarmupLR": LR}[kind],
                                    abs=1e-12)
    no_warmup = lr_per_update(render(template, cfg=make_cfg(optim={"warmup_steps": 0}), total_steps=20), 3)
    assert no_warmup[0] == pytest.approx(LR, rel=1e-9) and no_warmup[1] == pytest.approx(LR, rel=1e-9)


@pytest.mark.parametrize("params, message", [
    ({"warmup_num_steps": -3}, "scheduler.params.warmup_num_steps=-3 must be >= 1"),
    ({"warmup_num_steps": 2.5}, "scheduler.params.warmup_num_steps=2.5 must be an integer"),
    ({"total_num_steps": 0}, "scheduler.params.total_num_steps=0 must be >= 1"),
    ({"cos_min_ratio": 1.5}, r"scheduler.params.cos_min_ratio=1.5 must be within \[0, 1\]"),
    ({"warmup_min_ratio": -0.1}, r"scheduler.params.warmup_min_ratio=-0.1 must be within \[0, 1\]"),
    ({"cos_min_ratio": "0.1"}, "scheduler.params.cos_min_ratio='0.1' must be a finite number"),
    ({"cos_min_ratio": True}, "scheduler.params.cos_min_ratio=True must be a finite number"),
    ({"warmup_type": "cosine"}, r"scheduler.params.warmup_type='cosine' must be one of \('linear', 'log'\)"),
    ({"warmup_steps": 3}, "scheduler.params.warmup_steps: WarmupCosineLR takes no such argument "
                          r"\(did you mean 'warmup_num_steps'\?\)"),
])
def test_a_schedule_number_deepspeed_would_take_or_crash_on_is_one_line(params, message):
    """Explicit values of the template's scheduler.params: DeepSpeed hands them to the class as they are
    (a negative warm-up was a ValueError traceback from deepspeed.initialize, after the run directory)."""
    template = read_ds_template(ROOT / "ds_configs" / "zero2.json")
    template["scheduler"]["params"].update(params)
    with pytest.raises(UserError, match=f"^t.json: {message}"):
        render(template)
    with pytest.raises(UserError, match=r"scheduler.type='Cosine' is not a schedule DeepSpeed knows; use one of "
                                        "LRRangeTest, OneCycle"):
        render({"scheduler": {"type": "Cosine", "params": {}}})
    with pytest.raises(UserError, match="scheduler.params must be an object of WarmupLR's arguments"):
        render({"scheduler": {"type": "WarmupLR", "params": [1]}})
    assert render({"scheduler": {"type": "StepLR", "params": {"step_size": 3}}})["scheduler"]["params"] == {
        "step_size": 3}  # torch's schedules too, by their own arguments


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
def test_an_optimizer_argument_the_class_deepspeed_builds_does_not_take_is_one_line(path):
    """torch's AdamW where torch_adam, DeepSpeedCPUAdam under offload: each template's optimizer renders,
    and a misspelt or foreign argument (a TypeError traceback from deepspeed.initialize) is one line."""
    template = read_ds_template(path)
    cls = "DeepSpeedCPUAdam" if path.stem.endswith("_offload") else "AdamW"
    render(template)
    template["optimizer"]["params"]["amsgrads"] = True
    with pytest.raises(UserError, match=rf"^t.json: optimizer.params.amsgrads: {cls} takes no such argument "
                                        r"\(did you mean 'amsgrad'\?\)"):
        render(template)
    del template["optimizer"]["params"]["amsgrads"]
    template["optimizer"]["params"]["max_grad_norm"] = 1.0
    with pytest.raises(UserError, match="max_grad_norm: DeepSpeed clips by gradient_clipping; remove it and set "
                                        "train.grad_clip"):
        render(template)
