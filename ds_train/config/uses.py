"""Which command reads which section of the run config, and the one rule that refuses a key the
command would ignore.

A run config describes a `train` run (pretraining, SFT, or DPO when data.format is preference) or a
`ript` run. The other commands that take one read it as the run it is for: `dry-run` rehearses a
train run's steps, `parity` compares a train run's losses, `prepare --config` tokenises a train
run's data: each is checked as `train`. `estimate` (and the doctor's memory plan) plans either kind
(it counts ript's vLLM engine too): a section either run reads is used. `launch` and `slurm` check
the command after `--`. Library callers that name no command get the same (either run).

A key set to other than its default in a section its command does not read is one error: it would
be ignored. Every section of RunConfig, nested ones included, has a row in USES
(tests/test_config.py checks it), so a section added later falls under the rule with its row. A
row may name one key (`data.chat_template`): the longest row that is a prefix of a key decides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

TRAIN, RIPT = "train", "ript"
BOTH = (TRAIN, RIPT)
# command -> the runs whose sections it reads (None: a library caller that names no command)
READS = {"train": (TRAIN,), "ript": (RIPT,), "dry-run": (TRAIN,), "parity": (TRAIN,), "parity-worker": (TRAIN,),
         "prepare": (TRAIN,), "estimate": BOTH, None: BOTH}


@dataclass(frozen=True)
class Use:
    """The runs that read a section (or key), and a condition on the config it needs besides."""

    runs: tuple[str, ...]
    when: Callable | None = None  # (RunConfig) -> bool
    what: str = ""  # the condition, in words


USES = {
    "output_dir": Use(BOTH), "seed": Use(BOTH), "model": Use(BOTH),
    "model.lora": Use(BOTH, lambda c: c.model.lora.rank > 0, "LoRA (model.lora.rank > 0)"),
    "data": Use((TRAIN,)),  # ript's prompts come from its tasks, the tokenizer from model.path
    "data.chat_template": Use(BOTH),  # ript: the template a dataset task's prompts are rendered with
    "train": Use(BOTH),  # ript: the batch, seq_len, clipping, the non-finite handling
    "train.max_steps": Use((TRAIN,)),  # ript: ript.iterations
    "train.eval_every": Use((TRAIN,)), "train.eval_batches": Use((TRAIN,)),  # ript: ript.eval_*
    "train.loss_tile_tokens": Use((TRAIN,)), "train.fused_loss": Use((TRAIN,)),  # ript's update: whole log-probs
    "train.debug_loss_fault": Use((TRAIN,)),
    "parallel": Use(BOTH), "optim": Use(BOTH), "checkpoint": Use(BOTH),
    "checkpoint.export_final": Use((TRAIN,)),  # ript exports with `ds-train export`
    "log": Use(BOTH),
    "log.sample_prompt": Use((TRAIN,)), "log.sample_tokens": Use((TRAIN,)),
    "log.sample_repetition_penalty": Use((TRAIN,)),
    "launch": Use(BOTH), "dist": Use(BOTH), "watchdog": Use(BOTH),
    "ript": Use((RIPT,)),
    "dpo": Use((TRAIN,), lambda c: c.data.format == "preference", "preference training (data.format: preference)"),
    "benchmarks": Use(BOTH, lambda c: bool(c.benchmarks.tasks), "lm-eval tasks (benchmarks.tasks)"),
}


def use_of(key: str) -> tuple[str, Use]:
    """The row deciding `key` (a dotted key): the longest row that is the key or a section above it."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        row = ".".join(parts[:n])
        if row in USES:
            return row, USES[row]
    raise KeyError(f"{key}: no row in ds_train/config/uses.py USES")


def _set_keys(written: dict, section, prefix: str):
    """(dotted key, value) of every key of `written` (the config as written) set to other than its
    default in `section` (a RunConfig section's default instance), nested sections walked."""
    for key, value in written.items():
        if not hasattr(section, key):
            continue  # an unknown key: refused by its own error
        default = getattr(section, key)
        if dataclasses.is_dataclass(default):
            if isinstance(value, dict):
                yield from _set_keys(value, type(default)(), f"{prefix}{key}.")
        elif value != default:
            yield f"{prefix}{key}", value


def unused_keys(cfg, raw: dict, command: str | None) -> list[str]:
    """One error for each key of `raw` (the config as written; a saved config.yaml writes every key,
    at its default where unset) that `command` would ignore (USES, READS)."""
    from ds_train.config import RunConfig

    runs, errs = READS[command], []
    for key, _ in _set_keys(raw if isinstance(raw, dict) else {}, RunConfig(), ""):
        row, use = use_of(key)
        if not set(runs) & set(use.runs):
            stars = ".*" if row != key else ""
            errs.append(f"{key}: set, but `ds-train {command}` does not read {row}{stars} (`ds-train "
                        f"{use.runs[0]}` does); remove it, or run `ds-train {use.runs[0]}`")
        elif use.when is not None and not use.when(cfg):
            errs.append(f"{key}: set, but only {use.what} uses {row}.*; remove it, or turn that on")
    return errs
