"""The run configuration: frozen dataclasses, one per section, each with its own checks.

Field metadata carries the help text `ds-train train --help-config` prints; ds_train/config/file.py
reads YAML and `key=value` overrides into these classes and reports every problem at once.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal

from ds_train.config.benchmarks import BenchmarksConfig
from ds_train.config.fields import NON_NEGATIVE, NOT_PATHS, POSITIVE, Range, Section, _f, out_of_bounds
from ds_train.config.model import ModelConfig
from ds_train.config.posttrain import DpoConfig, RiptConfig
from ds_train.fs import path_problems


@dataclass(frozen=True)
class DataConfig(Section):
    """The data: where it is prepared (data.dir), what from (data.sources) and how (format, tokenizer,
    mixture weights, packing)."""

    dir: str = _f("data/cache/python_stdlib", "Directory holding train.bin, val.bin and meta.json.", path=True)
    sources: list[str] = _f([], "Files or directories tokenised into data.dir when its .bin files are "
                           "missing: text (.txt, .py, .md, ...: a document each), JSONL (.jsonl, "
                           ".jsonl.gz), parquet, .csv/.arrow, a `datasets` save_to_disk directory; "
                           "`python-stdlib` is the bundled default corpus.", path=True)
    weights: list[float] = _f([], "A mixture: one weight per source, the share of training samples drawn "
                           "from it (normalised). Empty: every source in proportion to its size.")
    format: Literal["text", "sft", "preference"] = _f(
        "text", "text: pretraining on raw text. sft: conversations ('messages') or 'prompt'/'completion' pairs, "
                "rendered with the chat template, loss on the assistant's tokens only. preference: 'prompt', "
                "'chosen' and 'rejected' (strings or messages; without 'prompt', two conversations that share their "
                "start), trained with the dpo section's loss; a sample is a pair (two sequences).")
    chat_template: str = _f("", "sft: a Jinja chat template to render with, or the path of a .jinja file (its text "
                                 "is read into the config). Empty: the tokenizer's.")
    pack: Literal["auto", True, False] = _f(
        "auto", "sft: pack several examples per sequence (no attention across them; positions restart per "
        "example): auto (where the model's attention supports it, else one padded example per sequence), true, "
        "false.")
    overlong: Literal["drop", "truncate"] = _f("drop", "sft, preference: an example (a pair with a side) longer than "
                                                       "train.seq_len is dropped or truncated (counted and reported at "
                                                       "the start of a run).")
    workers: int = _f(0, "Processes that tokenise during prepare. 0: one per core (one for a "
                         "corpus under 8 MiB).", Range(0, note="0: one per core"))
    tokenizer: str = _f("", "Tokenizer directory. Empty: model.path's, else a byte-level BPE trained "
                            "on the sources into data.dir/tokenizer.", path=True)
    vocab_size: int = _f(4096, "Vocabulary size of the BPE trained when no tokenizer is given.",
                         Range(260, note="256 bytes + specials"))
    split_digits: bool = _f(False, "The BPE trained when no tokenizer is given makes every digit its own "
                                   "token (as Llama's and DeepSeek's do): numbers read digit by digit.")
    val_fraction: float = _f(0.02, "Share of the source documents held out into val.bin.", Range(0, 1, True, True))
    text_key: str = _f("text", "Field holding the text in JSONL sources.")
    reprepare: bool = _f(False, "Re-prepare data.dir when its sources, tokenizer or vocabulary changed "
                                "since it was prepared, instead of stopping.")

    def check(self) -> list[str]:
        errs = []
        if not self.dir.strip():
            errs.append("data.dir: must not be empty (it would prepare into the current directory); give "
                        "the directory that holds or will hold train.bin, val.bin and meta.json")
        if self.weights:
            if len(self.weights) != len(self.sources):
                errs.append(f"data.weights: {len(self.weights)} weight(s) for {len(self.sources)} source(s); give "
                            f"one per entry of data.sources, or none")
            elif not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 for w in self.weights):
                errs.append(f"data.weights: {self.weights} must all be numbers > 0")
            elif self.format != "text":
                errs.append(f"data.weights: a mixture is for pretraining (data.format text); for {self.format}, "
                            f"repeat or subsample the files instead")
        return errs


@dataclass(frozen=True)
class TrainConfig(Section):
    """The loop: steps, the batch (DeepSpeed's names), evaluation, non-finite steps."""

    max_steps: int = _f(100, "Optimizer steps to train for.", POSITIVE)
    micro_batch_size: int = _f(8, "Sequences per GPU per forward pass (train_micro_batch_size_per_gpu; "
                                  "preference data: pairs).", POSITIVE)
    global_batch_size: int = _f(32, "Sequences per optimizer step across all ranks (train_batch_size; "
                                    "preference data: pairs).", POSITIVE)
    seq_len: int = _f(256, "Tokens per training sequence.", POSITIVE)
    loss_tile_tokens: int = _f(1024, "Compute the loss this many tokens at a time when a micro-batch holds "
                                     "more (per rank): the logits over the vocabulary (seq x vocab x 6 bytes "
                                     "in bf16) exist for one tile, in the forward and recomputed in the "
                                     "backward, never for the whole sequence. 0: never tile. The start-up "
                                     "probe checks it against the model's own loss: a model that soft-caps or "
                                     "cuts its logits after the head keeps them whole (refused where set "
                                     "explicitly).", NON_NEGATIVE)
    fused_loss: bool = _f(False, "In the tiled loss, compute each tile's gradients in its forward (a fused "
                                 "linear cross-entropy in torch, as Liger's): the output head's matmul is not "
                                 "recomputed in the backward; its weight gradient is held meanwhile. A head "
                                 "other than a plain Linear layer (LoRA, tensor-parallel) is recomputed either "
                                 "way. Off by default: on an H100 it ran at 0.987x the recomputed tiles.")
    mlp_tile_positions: int = _f(8192, "Run each layer's MLP this many positions of a sequence at a time when "
                                       "a rank holds more positions of a sequence (seq_len / parallel.sequence; "
                                       "DeepSpeed's TiledMLP): its largest activations (about 3 x "
                                       "intermediate_size values a token) exist for one tile, the MLP recomputed "
                                       "tile by tile in the backward. 0: never tile. Checked against the model's "
                                       "own MLP by the start-up probe.", NON_NEGATIVE)
    grad_clip: float = _f(1.0, "Gradient clipping by global norm (0 turns it off).", NON_NEGATIVE)
    eval_every: int = _f(0, "Evaluate on val.bin every N steps (0: only at the end).", NON_NEGATIVE)
    eval_batches: int = _f(4, "Micro-batches per rank in each evaluation.", POSITIVE)
    nonfinite: Literal["skip", "stop"] = _f(
        "skip", "An optimizer step whose gradients are not finite is never applied (training and RIPT). skip: "
                "carry on (counted as train/skipped_steps, policy/skipped_steps); stop: exit after "
                "nonfinite_patience such steps in a row.")
    nonfinite_patience: int = _f(3, "Consecutive non-finite steps before train.nonfinite=stop exits.", POSITIVE)
    debug_nonfinite_steps: list[int] = _f([], "Fault injection: steps (RIPT: iterations) whose loss is made "
                                         "infinite, to rehearse the non-finite handling.")
    debug_loss_fault: str = _f("", "Fault injection: KIND[:STAGE][,...] breaks the loss math on purpose, so "
                                   "that `ds-train parity` is seen to catch it (under ZeRO stage STAGE only, when "
                                   "given): mean_of_rank_means, drop_micro_batch, sequence_divisor, "
                                   "router_counts_local or aux_loss_summed.")

    def check(self) -> list[str]:
        from ds_train.faults import loss_fault_problem

        problem = loss_fault_problem(self.debug_loss_fault)
        return [f"train.debug_loss_fault: {problem}"] if problem else []


@dataclass(frozen=True)
class OptimConfig(Section):
    """AdamW and its schedule (warm-up, cosine decay), rendered into the DeepSpeed JSON's "auto" values."""

    lr: float = _f(3e-4, "Peak learning rate (AdamW), before optional batch-size scaling.", POSITIVE)
    min_lr_ratio: float = _f(0.1, "Final learning rate of the cosine decay, as a fraction of lr.", (0, 1))
    warmup_steps: int = _f(10, "Linear warm-up steps: update k of them trains at k/(warmup_steps+1) of lr; 0: lr "
                              "from the first update.", NON_NEGATIVE)
    weight_decay: float = _f(0.1, "AdamW weight decay.", NON_NEGATIVE)
    betas: list[float] = _f([0.9, 0.95], "AdamW betas.")
    eps: float = _f(1e-8, "AdamW epsilon.", POSITIVE)
    lr_scaling: Literal["none", "linear", "sqrt"] = _f(
        "none", "Scale lr by global_batch_size / reference_batch_size (linear) or its square root.")
    reference_batch_size: int = _f(0, "Global batch size at which optim.lr was tuned (for lr_scaling).",
                                   NON_NEGATIVE)

    def check(self) -> list[str]:
        errs = []
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            errs.append(f"optim.betas: {self.betas} must be two numbers in [0, 1)")
        if self.lr_scaling != "none" and self.reference_batch_size <= 0:
            errs.append(f"optim.reference_batch_size: set it (> 0) when optim.lr_scaling is "
                        f"{self.lr_scaling!r}")
        return errs


@dataclass(frozen=True)
class ParallelConfig(Section):
    """How each data-parallel group of ranks divides a model (ds_train/plan/parallel.py)."""

    sequence: int = _f(1, "Sequence-parallel ranks per data-parallel group (DeepSpeed Ulysses): each holds "
                          "1/sequence of every sequence. 1: off. The data-parallel size is world / "
                          "(sequence x tensor).", POSITIVE)
    tensor: int = _f(1, "Tensor-parallel ranks per data-parallel group (DeepSpeed AutoTP): each holds "
                        "1/tensor of every layer. 1: off.", POSITIVE)
    expert: int = _f(1, "Expert-parallel ranks (DeepSpeed AutoEP), a mixture-of-experts model only: each of "
                        "`expert` data-parallel ranks holds 1/expert of every MoE layer's experts and the tokens "
                        "routed to them travel there and back. Cut from the data-parallel ranks: the world size and "
                        "the batch math stay as they are. 1: off.", POSITIVE)


SAVE_PHASES = ("unmarked", "written", "rank_files", "marked", "latest")  # checkpoint.PHASES


@dataclass(frozen=True)
class CheckpointConfig(Section):
    """DeepSpeed's partitioned checkpoints: when to save, how many to keep, where to resume from."""

    every: int = _f(0, "Save a partitioned DeepSpeed checkpoint every N steps (0: only at the end).", NON_NEGATIVE)
    keep: int = _f(3, "Keep the newest K complete checkpoints (0: keep all).", NON_NEGATIVE)
    resume: str = _f("auto", "auto: continue from the newest checkpoint in output_dir every rank holds "
                             "whole, if any; none: start fresh (refused where checkpoints exist); "
                             "restart: delete output_dir's checkpoints and metrics, start fresh; or a "
                             "tag (step_00000100) or checkpoint path.", path=True)
    save_final: bool = _f(True, "Save a checkpoint when training ends.")
    async_save: bool = _f(False, "Write periodic saves in the background: training stops only while "
                                 "the state is copied to host memory (which needs room for one more copy "
                                 "of this rank's checkpoint state). The last save and a stop's block.")
    export_final: bool = _f(False, "At the end, also write a Hugging Face model directory "
                                   "(output_dir/hf_export_<tag>) from the final checkpoint.")
    load_universal: bool = _f(False, "Resume through DeepSpeed's universal checkpoint even when the "
                                     "world size and ZeRO stage are unchanged (automatic otherwise).")
    debug_fault: str = _f("", "Fault injection: ACTION:PHASE:STEP[:RANK] stops the save of STEP at "
                              "PHASE (unmarked, written, rank_files, marked, latest) on RANK (default: "
                              "every rank); ACTION kill (SIGKILL, a crash) or enospc (a full disk).")

    def check(self) -> list[str]:
        errs = []
        if not self.resume:
            errs.append("checkpoint.resume: must be auto, none, restart, a tag or a path")
        if self.debug_fault:
            parts = self.debug_fault.split(":")
            if (len(parts) not in (3, 4) or parts[0] not in ("kill", "enospc") or parts[1] not in SAVE_PHASES
                    or not all(p.isdigit() for p in parts[2:])):
                errs.append(f"checkpoint.debug_fault: {self.debug_fault!r} is not ACTION:PHASE:STEP[:RANK] "
                            f"(kill or enospc; {', '.join(SAVE_PHASES)}; a step number; a rank)")
        if self.export_final and not self.save_final:
            errs.append("checkpoint.export_final: needs checkpoint.save_final: true (it exports the final checkpoint)")
        return errs


@dataclass(frozen=True)
class LogConfig(Section):
    """Metrics (rank 0's sinks), the progress bar, plots, MFU and the final sample."""

    every: int = _f(10, "Log rank-aggregated metrics every N steps.", POSITIVE)
    wandb: Literal["off", "offline", "online"] = _f("off", "Weights & Biases logging (rank 0 only).")
    wandb_project: str = _f("ds_train", "Weights & Biases project name.")
    tensorboard: bool = _f(False, "Also write the metrics as TensorBoard events (rank 0, output_dir/tensorboard/).")
    plots: bool = _f(True, "A finished run writes PNG plots of its metrics into output_dir/plots/.")
    progress: bool = _f(True, "Show a progress bar with ETA on rank 0.")
    peak_tflops: float = _f(0.0, "Peak dense TFLOP/s per device for MFU (0: look up the GPU).", NON_NEGATIVE)
    sample_prompt: str = _f("", "Text to continue with the trained model at the end ('' skips it).")
    sample_tokens: int = _f(64, "Tokens generated for the final sample.", NON_NEGATIVE)
    sample_repetition_penalty: float = _f(
        1.0, "The final sample is greedy (the likeliest token each time); above 1, tokens already there are "
        "made less likely first (Hugging Face's repetition_penalty), which keeps a small model out of loops.",
        POSITIVE)


@dataclass(frozen=True)
class LaunchConfig(Section):
    """What `ds-train launch` forwards to every node."""

    env: list[str] = _f([], "Names of environment variables `ds-train launch` forwards to every node (through "
                       "output_dir/.deepspeed_env). NCCL_*, TORCH_NCCL_*, TORCH_DISTRIBUTED_DEBUG, "
                       "GLOO_SOCKET_IFNAME, CUDA_LAUNCH_BLOCKING, PYTORCH_CUDA_ALLOC_CONF, DS_ACCELERATOR, "
                       "WANDB_MODE, WANDB_PROJECT, HF_HOME, TORCH_EXTENSIONS_DIR and PYTHONPATH go anyway when "
                       "set; names that look like secrets (*_TOKEN, *_API_KEY, *SECRET*, *PASSWORD*) only "
                       "when listed here.")

    def check(self) -> list[str]:
        bad = [n for n in self.env if not isinstance(n, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n)]
        if bad:
            return [f"launch.env: {', '.join(map(repr, bad))} not a variable name (letters, digits, _)"]
        return []


@dataclass(frozen=True)
class DistConfig(Section):
    """The process group: its timeout, and how long start-up waits for every rank."""

    timeout_s: float = _f(1800.0, "Process-group timeout: a collective still waiting after this long fails "
                                  "(torch's default, 30 minutes). The watchdog names a hang long before.", POSITIVE)
    join_timeout_s: float = _f(300.0, "Start-up: every rank must reach the rendezvous within this long; the "
                                      "ranks that did not are named with their node and host.", POSITIVE)


WATCHDOG_FAULTS = ("stall", "slow", "raise", "kill", "device_assert")


@dataclass(frozen=True)
class WatchdogConfig(Section):
    """Heartbeats, hangs and stragglers (ds_train/observe/watchdog.py)."""

    stall_s: float = _f(300.0, "A rank that makes no progress this long (no new phase of a step, no checkpoint "
                               "I/O while saving) ends the job with a hang report naming it (exit 5); 0 "
                               "turns the watchdog off. Must be below dist.timeout_s.", Range(0, note="0: off"))
    heartbeat_s: float = _f(2.0, "How often each rank writes its heartbeat (output_dir/heartbeats/rank_<r>.json).",
                            POSITIVE)
    straggler_ratio: float = _f(1.3, "On logging steps, a rank whose compute time per step (data + forward) "
                                     "exceeds the median of all ranks by this factor is reported.",
                                Range(1, low_open=True))
    debug_fault: str = _f("", "Fault injection: stall:RANK:STEP (the rank stops at STEP; STEP 0: rank 0 in its "
                              "first forward scoring benchmarks at_start), "
                              "slow:RANK:SECONDS[:FROM_STEP] (it sleeps that long every step), "
                              "raise:RANK:STEP (an exception), "
                              "kill:RANK:STEP (SIGKILL, as the OOM killer does), "
                              "device_assert:RANK:STEP (an index out of range in a kernel: on a GPU the "
                              "real CUDA error 'device-side assert triggered'). RANK rN: rollout rank N "
                              "(ript.rollout_ranks_per_node), STEP its batch.")

    def check(self) -> list[str]:
        errs = []
        if self.debug_fault:
            parts = self.debug_fault.split(":")
            ok = (len(parts) == 3 or len(parts) == 4 and parts[0] == "slow" and parts[3].isdigit()) and \
                parts[0] in WATCHDOG_FAULTS and parts[1].removeprefix("r").isdigit()
            try:
                ok = ok and float(parts[2]) >= 0
            except ValueError:
                ok = False
            if not ok:
                errs.append(f"watchdog.debug_fault: {self.debug_fault!r} is not ACTION:RANK:ARG "
                            f"({', '.join(WATCHDOG_FAULTS)}; a rank, rN a rollout rank; a step, or seconds for "
                            f"slow)")
        return errs


@dataclass(frozen=True)
class RunConfig:
    """The run config; which command reads each section: ds_train/config/uses.py (a new section needs its row)."""

    output_dir: str = _f("runs/default", "Run directory: resolved configs, logs, metrics, checkpoints.", path=True)
    seed: int = _f(1234, "Seed for weights, data order and sampling.", (0, 2**32 - 1))
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    ript: RiptConfig = field(default_factory=RiptConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    benchmarks: BenchmarksConfig = field(default_factory=BenchmarksConfig)

    def check(self) -> list[str]:
        errs = out_of_bounds(self, "")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                errs += out_of_bounds(value, f.name) + value.check()
                errs += path_problems(value, f"{f.name}.", NOT_PATHS)
        if not self.output_dir:
            errs.append("output_dir: must not be empty")
        errs += path_problems(self, "", NOT_PATHS)
        if self.watchdog.stall_s >= self.dist.timeout_s:
            errs.append(f"watchdog.stall_s: {self.watchdog.stall_s:g} must be below dist.timeout_s="
                        f"{self.dist.timeout_s:g} (the watchdog names a hang before the process group "
                        f"times out)")
        if self.data.format == "preference" and self.parallel.sequence > 1:
            errs.append(f"parallel.sequence: {self.parallel.sequence} splits each sequence over ranks, and preference "
                        f"training sums a whole sequence's log-probs on one rank; set parallel.sequence=1 (pairs "
                        f"longer than one rank holds: use LoRA, activation checkpointing or ZeRO-3)")
        if self.data.format == "preference" and self.dpo.reference == "live" and self.parallel.tensor > 1:
            errs.append(f"dpo.reference: live with parallel.tensor={self.parallel.tensor}: ds_train builds the "
                        f"reference without AutoTP's split (a whole copy on every rank); use "
                        f"dpo.reference=precomputed (no copy while training), or ZeRO-3 (parallel.tensor=1) to "
                        f"partition both models")
        if self.data.split_digits and (self.data.tokenizer or self.model.path):
            errs.append(f"data.split_digits: applies to the BPE prepare trains when no tokenizer is given, but "
                        f"{'data.tokenizer' if self.data.tokenizer else 'model.path'} gives one; drop "
                        f"data.split_digits")
        return errs

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
