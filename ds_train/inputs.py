"""The check step: every input of a run read and checked once, before anything is written, and
handed to the run builder (ds_train/start.py) as one object.

    inputs = check_inputs(cfg, ds_config_path, config_check)  # train, dry-run, parity: model and data
    inputs = check_inputs(cfg, ds_config_path, data=False)    # ript: the model and its own tokenizer
    with build_run(inputs, topology.detect_env(), spec) as run: ...

What fails fast goes first: the DeepSpeed JSON and the model (its config, the architecture built
on the meta device, model.path's weights), then the run's config at its world size (check_config),
all before the data is prepared, which writes data.dir and can take minutes.

check_config is the one check of a run's config at its world size: each rank runs it before its data
is prepared and again once the tokenizer's vocabulary is known (start.build_run), and `ds-train launch
--check` / `slurm` run it on the launching host for the target world (ds_train/__main__.check_command).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

from ds_train.benchmarks import check_section
from ds_train.checkpoint.export import locate_model, resolve_source
from ds_train.config import RunConfig
from ds_train.data.datasets import Datasets, build_datasets
from ds_train.data.meta import META, check_vocab, load_meta, read_meta
from ds_train.data.prepare import ensure_prepared
from ds_train.data.tokenizer import load_tokenizer, vocabulary_id
from ds_train.dsconfig import check_optimizer, check_scheduler
from ds_train.dsconfig import read_ds_template
from ds_train.engine import render_ds_config
from ds_train.errors import UserError
from ds_train.model.build import resolve_dtype, supports_packing
from ds_train.model.hfconfig import build_hf_config, with_vocab
from ds_train.model.lora import check_lora
from ds_train.model.lora import enabled as lora_enabled
from ds_train.model.weights import fingerprint, weight_files
from ds_train.plan.batch import scaled_lr
from ds_train.plan.experts import expert_section
from ds_train.plan.parallel import Layout, check_layout, packs_under_sequence
from ds_train.topology import DistEnv, split_job


@dataclass(frozen=True)
class ModelSource:
    """The model a run starts from, resolved and checked."""

    hf_config: Any
    tokenizer: Any
    weights: Path | None  # a Hugging Face directory to load; None: from scratch (model.config)
    export_from: Path | None = None  # a ds_train run whose weights become <run dir>/init_model


@dataclass(frozen=True)
class RunInputs:
    cfg: RunConfig
    ds_config_path: str
    template: dict  # the DeepSpeed JSON as given (engine.render_ds_config completes it)
    source: ModelSource
    data: Datasets | None = None  # None: a run that reads no prepared data (ript)

    def data_id(self) -> dict:
        """What identifies the tokenizer and the prepared data, recorded in every checkpoint: the
        same data.dir re-prepared with another tokenizer would feed the saved weights other ids.
        Under LoRA also the frozen base (`base`: its weights' fingerprint), which the checkpoint
        does not hold: its adapters were trained on that base alone."""
        ids = {**(self.data.identity() if self.data else {}), "tokenizer": vocabulary_id(self.source.tokenizer)}
        if lora_enabled(self.cfg.model.lora):
            ids["base"] = base_fingerprint(self.source)
        return ids


def base_fingerprint(source: ModelSource) -> str:
    """model.path's weight files, or the ds_train run's checkpoint they are exported from; a model
    built from scratch is fixed by model.config and the seed, which every checkpoint records."""
    if source.weights is not None:
        return fingerprint(weight_files(source.weights))
    if source.export_from is not None:
        tag = resolve_source(source.export_from)
        return fingerprint(sorted(p for p in tag.tag_dir.iterdir() if p.is_file() and p.suffix == ".pt"))
    return "model.config"


def tokenizer_dir(cfg: RunConfig, model_dir: Path | None) -> str:
    """The tokenizer of the data: data.tokenizer, else the model's (model.path), else '' (the BPE
    `prepare` trains into data.dir). The one place this is decided."""
    return cfg.data.tokenizer or str(model_dir or "")


def model_dirs(cfg: RunConfig) -> tuple[Path | None, Path | None]:
    """model.path -> (the directory with config.json and the tokenizer, a ds_train run to export
    first); (None, None) for a model trained from scratch."""
    return locate_model(cfg.model.path) if cfg.model.path else (None, None)


def _hf_config(cfg: RunConfig, model_dir: Path | None, weights: bool):
    """The model's config, checked (`weights`: model.path's weights too). A model trained from
    scratch gets a stand-in vocabulary size until its tokenizer is known (with_vocab)."""
    stand_in = int(cfg.model.config.get("vocab_size") or cfg.data.vocab_size)
    model_cfg = replace(cfg.model, path=str(model_dir or ""))
    return build_hf_config(model_cfg, stand_in, cfg.train.seq_len, weights=weights)


@dataclass(frozen=True)
class ConfigChecked:
    """What check_config found: the layout, the schedule's length, the scaled learning rate and, for
    a known device, the precision and the rendered ds_config."""

    layout: Layout
    total_steps: int
    lr: float
    dtype: str | None = None  # None: no device given (the launch host before its probe)
    ds_config: dict | None = None


def check_config(cfg: RunConfig, template: dict, spec, world_size: int, hf_config, source: str,
                 device: str | None = None, bf16: bool = True, local_world_size: int | None = None) -> ConfigChecked:
    """The one check of a run's config at `world_size` with the model's config, before anything is
    written (pure): the layout and batch math (spec.check: check_layout), LoRA's targets, the command's
    own model checks (spec.check_model: ript's rollout engine, ...), and, for a `device` ("cuda" or
    "cpu"; `bf16`: it has bf16), the precision and the ds_config rendered from `template` (`source`: its
    file). `local_world_size`: ranks a node (default: all on one)."""
    layout, total_steps = spec.check(cfg, template, world_size, hf_config)
    check_lora(cfg.model.lora, hf_config)
    check_section(cfg)  # lm_eval's tasks (benchmarks.tasks), as lm_eval will take them
    if spec.check_model is not None:
        spec.check_model(cfg, hf_config, world_size, local_world_size or world_size, device)
    lr = scaled_lr(cfg.optim.lr, layout.batch.global_batch_size, cfg.optim.reference_batch_size, cfg.optim.lr_scaling)
    if device is None:
        return ConfigChecked(layout, total_steps, lr)
    dtype = resolve_dtype(cfg.model.dtype, device, bf16)
    ds_config = render_ds_config(template, cfg, layout.batch, dtype=dtype, lr=lr, total_steps=total_steps,
                                 hidden_size=hf_config.get_text_config().hidden_size, on_gpu=device == "cuda",
                                 experts=expert_section(cfg, hf_config), source=source)
    return ConfigChecked(layout, total_steps, lr, dtype, ds_config)


def check_template(cfg: RunConfig, ds_config_path: str) -> dict:
    """The DeepSpeed JSON read and checked with the run config, before the world size is known (the
    ranks' check step and the launch preflight): its names, its scheduler's and optimizer's numbers,
    what the model-parallel sizes cannot take with it. Returns it."""
    template = read_ds_template(ds_config_path)
    check_ds_names(template, str(ds_config_path))
    check_scheduler(template, str(ds_config_path))  # the template's own numbers, before the data is prepared
    check_optimizer(template, str(ds_config_path))
    check_layout(cfg, template, None)  # what needs no world size; check_config checks the rest
    return template


def check_data_meta(cfg: RunConfig, hf_config) -> None:
    """The prepared data against the model from data.dir's meta.json alone, as the launch host checks it
    (it reads no tokens and writes nothing): every token id the data holds is an id of the model's
    vocabulary, where that vocabulary is the model's own (model.path or model.config.vocab_size; a model
    from scratch takes the data tokenizer's). A data.dir not prepared yet, or not on this host, is the
    ranks' to check."""
    if not (cfg.model.path or "vocab_size" in cfg.model.config) or not (Path(cfg.data.dir) / META).is_file():
        return
    check_vocab(read_meta(Path(cfg.data.dir)), getattr(hf_config, "vocab_size", None), cfg.data.dir)


# The rank's check of its config at its world size, given the template and the model's config
# (check_inputs runs it before the data is prepared).
ConfigCheck = Callable[[dict, Any], Any]


def check_inputs(cfg: RunConfig, ds_config_path: str, config_check: ConfigCheck | None = None,
                 data: bool = True) -> RunInputs:
    """The DeepSpeed JSON, the model, the config at the run's world size (`config_check`, with the
    template and the model's config), and (`data`) the prepared data, prepared on first use: every
    check before the first write (data.dir's preparation), nothing written in the run directory."""
    template = check_template(cfg, ds_config_path)
    model_dir, export_from = model_dirs(cfg)
    hf_config = _hf_config(cfg, model_dir, weights=export_from is None)  # a run's weights: in its checkpoint
    check_lora(cfg.model.lora, hf_config)
    if config_check is not None:
        config_check(template, hf_config)
    if not data:  # the model's own tokenizer
        source = ModelSource(hf_config, load_tokenizer(model_dir), model_dir if export_from is None else None,
                             export_from)
        return RunInputs(cfg, str(ds_config_path), template, source)
    tok_dir = tokenizer_dir(cfg, model_dir)
    meta = ensure_prepared(cfg.data, tok_dir)
    tokenizer = load_tokenizer(tok_dir or meta["tokenizer"])
    hf_config = with_vocab(hf_config, cfg.model, len(tokenizer))
    check_vocab(meta, getattr(hf_config, "vocab_size", None), cfg.data.dir)
    check_tokenizer_fits(cfg, hf_config, tokenizer, tok_dir or meta["tokenizer"])
    check_token_ids(cfg, hf_config)
    datasets = build_datasets(cfg.data, meta, cfg.train.seq_len, cfg.seed,
                              supports_packing(hf_config) and (cfg.parallel.sequence == 1 or packs_under_sequence(
                                  cfg.model.attn_implementation)),
                              type(hf_config).__name__)
    source = ModelSource(hf_config, tokenizer, model_dir if export_from is None else None, export_from)
    return RunInputs(cfg, str(ds_config_path), template, source, datasets)


TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id")


def check_ds_names(template: dict, source: str) -> None:
    """The names the DeepSpeed JSON gives its optimizer and scheduler are ones DeepSpeed builds:
    otherwise deepspeed.initialize fails after the run directory was written."""
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES

    opt = template.get("optimizer", {}).get("type") if isinstance(template.get("optimizer"), dict) else None
    if opt is not None and not (isinstance(opt, str) and (opt.lower() in DEEPSPEED_OPTIMIZERS
                                                          or isinstance(getattr(torch.optim, opt, None), type))):
        raise UserError(f"{source}: optimizer.type: {opt!r} is not an optimizer DeepSpeed knows; use one of "
                        f"{', '.join(DEEPSPEED_OPTIMIZERS)} (or a torch.optim class name)")
    sched = template.get("scheduler", {}).get("type") if isinstance(template.get("scheduler"), dict) else None
    if sched is not None and sched not in VALID_LR_SCHEDULES:
        raise UserError(f"{source}: scheduler.type: {sched!r} is not a DeepSpeed scheduler; use one of "
                        f"{', '.join(VALID_LR_SCHEDULES)}")


def check_token_ids(cfg: RunConfig, hf_config) -> None:
    """Special token ids given in model.config (bos, eos, pad, ...) are ids of the vocabulary (or
    null): transformers only warns, and the first sample or padded batch fails."""
    vocab = getattr(hf_config, "vocab_size", None)
    if not isinstance(vocab, int):
        return
    for key in TOKEN_ID_KEYS:
        value = cfg.model.config.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab
                                         for i in ids):
            raise UserError(f"model.config.{key}: {value!r} is not a token id of the vocabulary (0 to "
                            f"{vocab - 1}); give an id in that range, or null")


def check_tokenizer_fits(cfg: RunConfig, hf_config, tokenizer, tok_dir: str) -> None:
    """model.config.vocab_size must hold every id the tokenizer can produce (a prompt, a sample,
    a RIPT rollout), not only those the prepared data happens to use."""
    vocab = getattr(hf_config, "vocab_size", None)
    if "vocab_size" in cfg.model.config and isinstance(vocab, int) and len(tokenizer) > vocab:
        raise UserError(f"model.config.vocab_size: {vocab} is smaller than the tokenizer {str(tok_dir)!r} "
                        f"({len(tokenizer)} tokens); set it to {len(tokenizer)} or more, or leave it out "
                        f"(the tokenizer's size is taken)")


def model_config(cfg: RunConfig):
    """The model's config, checked, without the data and without reading the weights: its shape (a
    model trained from scratch at a stand-in vocabulary size), for planning (estimate, dry run, the
    launch preflight, parity --shrink), which would otherwise scan a large model's weights for
    nothing. A run checks them (check_inputs)."""
    return _hf_config(cfg, model_dirs(cfg)[0], weights=False)


def plan_config(cfg: RunConfig):
    """The model's config for planning (estimate, dry run, the launch preflight's memory check): its
    vocabulary from model.config or model.path, else from the prepared data's tokenizer (prepared
    on first use, as `train` would)."""
    hf_config = model_config(cfg)
    if cfg.model.path or "vocab_size" in cfg.model.config:
        return hf_config
    d = cfg.data
    if not (Path(d.dir) / META).is_file() and not d.sources:
        raise UserError(f"model.config.vocab_size is not set and {d.dir!r} is not prepared; set "
                        f"model.config.vocab_size or run `ds-train prepare --config ...`")
    meta = ensure_prepared(d, tokenizer_dir(cfg, None)) if d.sources else load_meta(d.dir)
    return with_vocab(hf_config, cfg.model, len(load_tokenizer(meta["tokenizer"])))


def check_launch(cfg: RunConfig, ds_config_path: str, spec, world_size: int,
                 local_world_size: int | None = None, device: str | None = None) -> Any:
    """What `ds-train launch --check` / `slurm` check of the command every rank will run, at the target
    world size: the ranks' own checks of the DeepSpeed JSON (check_template) and of the config
    (check_config), with the model's config (no weights: each rank reads those) and, for a `device` the
    hosts were found to have, the rendered ds_config; the prepared data from its meta.json alone
    (check_data_meta). With rollout ranks (ript.rollout_ranks_per_node) the batch is the trainers' world's.
    Returns the batch plan."""
    if spec.kind.name == "ript" and cfg.ript.rollout_ranks_per_node:
        job = DistEnv(0, 0, world_size, local_world_size or world_size, 0, "", 0, "launch")
        trainers = split_job(job, cfg.ript.rollout_ranks_per_node).split.world("trainer")
        world_size, local_world_size = trainers.world_size, trainers.local_world_size
    template = check_template(cfg, ds_config_path)
    hf_config = model_config(cfg)
    checked = check_config(cfg, template, spec, world_size, hf_config, ds_config_path, device,
                           local_world_size=local_world_size)
    if spec.kind.name == "train":  # ript reads no prepared data
        check_data_meta(cfg, hf_config)
    return checked.layout.batch


def rank_config_check(cfg: RunConfig, spec, env, ds_config_path: str) -> ConfigCheck:
    """check_config at this rank's world, on its device: what check_inputs runs before the data."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    return partial(_config_check, cfg, spec, env, ds_config_path, accel.device_name(), accel.is_bf16_supported())


def _config_check(cfg, spec, env, ds_config_path, device, bf16, template, hf_config):
    return check_config(cfg, template, spec, env.world_size, hf_config, ds_config_path, device, bf16,
                        env.local_world_size)
