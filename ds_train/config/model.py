"""The model's sections of the run config: `model.*` (ModelConfig: a local Hugging Face directory or
an architecture to train from scratch, and how it runs) and `model.lora.*` (LoraConfig: LoRA
adapters, QLoRA's quantised base), each with its own checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ds_train.config.fields import NON_NEGATIVE, POSITIVE, Range, Section, _f, out_of_bounds
from ds_train.fs import path_problem


@dataclass(frozen=True)
class LoraConfig(Section):
    """LoRA (peft): low-rank adapters on the model's linear layers; only they (and modules_to_save)
    train, the base stays frozen. model.lora.rank > 0 turns it on."""

    rank: int = _f(0, "Adapter rank r. 0: off (every weight trains).", NON_NEGATIVE)
    alpha: float = _f(16.0, "Scaling numerator: an adapter's update is scaled by alpha / rank.", POSITIVE)
    dropout: float = _f(0.0, "Dropout on the adapters' input (0: none).", Range(0, 1, high_open=True))
    target_modules: list[str] = _f(["all-linear"], "Module names (or name suffixes) that get adapters; "
                                   "all-linear: every linear layer but the output head.")
    modules_to_save: list[str] = _f([], "Modules trained whole beside the adapters (e.g. embed_tokens, "
                                        "lm_head), saved with them.")
    load_in: Literal["none", "4bit", "8bit"] = _f("none", "Quantised base weights (QLoRA, bitsandbytes: a CUDA "
                                                          "GPU, or its CPU backend from 0.50): none, 4bit or 8bit.")

    def check(self) -> list[str]:
        errs = []
        if self.rank and not self.target_modules and not self.modules_to_save:
            errs.append(f"model.lora: rank {self.rank} with empty target_modules and modules_to_save trains "
                        f"nothing; list target_modules (e.g. [all-linear] or [q_proj, v_proj]), or set "
                        f"model.lora.rank=0 to train every weight")
        if not self.rank and self.load_in != "none":
            errs.append(f"model.lora.load_in={self.load_in} needs LoRA (a quantised base cannot train); set "
                        f"model.lora.rank")
        return errs


@dataclass(frozen=True)
class ModelConfig(Section):
    """The model: a local Hugging Face directory or an architecture to train from scratch, and how it runs."""

    path: str = _f("", "Local Hugging Face model directory (weights + tokenizer) to start from.", path=True)
    config: dict[str, Any] = _f({}, "Architecture to train from scratch: Hugging Face config keys, `model_type` "
                          "included (e.g. llama). vocab_size defaults to the tokenizer's.")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = _f(
        "auto", "Training precision. auto: bf16 on a GPU that supports it, else fp32.")
    tf32: bool = _f(True, "On a GPU (Ampere or later), let fp32 matmuls and convolutions use TF32 tensor cores "
                          "(a 10-bit mantissa, several times faster); false: full fp32. `ds-train parity` turns "
                          "it off for its fp32 runs unless --tf32.")
    activation_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")
    compile: Literal["auto", True, False] = _f(
        "auto", "torch.compile each decoder layer (the loss stays eager); the first steps take a few seconds "
                "more while it compiles. auto: on a CUDA GPU (1.39x the tokens/s of eager, and 9 GiB less memory, "
                "for a 1.1B Llama on an H100), off elsewhere, with model.liger_kernels, a quantised base "
                "(model.lora.load_in) or parallel.expert > 1 (true is refused with the last two). The start-up probe "
                "checks the compiled layers against eager ones on a small model of the type (auto: off where they "
                "differ; true: refused).")
    liger_kernels: bool = _f(False, "Liger's Triton kernels for RMSNorm, RoPE and the SwiGLU MLP (`pip install "
                                    "liger-kernel`; a CUDA GPU). Where they cannot run the run goes on without "
                                    "them and says so in one line.")
    attn_implementation: str = _f("sdpa", "Hugging Face attention implementation (sdpa, eager, ...).")
    allow_new_weights: bool = _f(False, "Allow tensors missing from model.path's weights (a new head); "
                                        "they are initialised from the seed on the CPU generator, as a model "
                                        "from scratch is (equal under every ZeRO stage), and listed.")
    lora: LoraConfig = field(default_factory=LoraConfig)

    def check(self) -> list[str]:
        errs = out_of_bounds(self.lora, "model.lora") + self.lora.check()
        if self.lora.load_in != "none" and not self.path:
            errs.append(f"model.lora.load_in={self.lora.load_in}: a quantised base is loaded from model.path; a "
                        f"model trained from scratch (model.config) cannot be quantised")
        if self.compile is True and self.lora.load_in != "none":
            errs.append(f"model.compile=true with model.lora.load_in={self.lora.load_in}: {QUANTISED_EAGER}; leave "
                        f"model.compile at auto (eager layers on a quantised base) or train LoRA on a full base")
        if self.compile is True and self.liger_kernels:
            errs.append("model.compile=true with model.liger_kernels=true: Liger's Triton kernels inside compiled "
                        "layers failed on a GPU (an illegal memory access in the backward; liger-kernel 0.8.5, "
                        "torch 2.11, H200, 2026-11-28); use one of them (model.compile=auto leaves the layers "
                        "eager under Liger's kernels)")
        if bool(self.path) == bool(self.config):
            errs.append("model: set exactly one of model.path (a local HF directory) "
                        "or model.config (an architecture to train from scratch)")
        if self.config and "model_type" not in self.config:
            errs.append("model.config: missing `model_type` (for example `model_type: llama`)")
        elif self.config and not isinstance(self.config["model_type"], str):
            errs.append(f"model.config.model_type: {self.config['model_type']!r} must be a string (for "
                        f"example `model_type: llama`)")
        if self.path and not path_problem(self.path, "model.path") and not Path(self.path).is_dir():
            errs.append(f"model.path: {self.path!r} is not a directory (the hub is not reachable; "
                        "point it at a local model directory)")
        return errs


# Why compiled layers do not run on a layout (model.compile=true is refused there, auto leaves them eager),
# each measured on this CPU against eager with `ds-train parity` (tests/test_compiled_layers.py).
QUANTISED_EAGER = ("compiled layers over bitsandbytes' 4-bit layers differ from eager beyond the fp32 tolerance "
                   "(gradient norm 2e-5 at the first step, 4e-4 by the third; the CPU backend, 2026-11-29)")
EXPERTS_EAGER = ("torch.compile cannot trace AutoEP's grouped expert matmul (torch._grouped_mm fails dynamo's "
                 "fake-tensor run in fp32; torch 2.13, 2026-11-29)")


def eager_layers(cfg) -> str:
    """Why `model.compile: auto` leaves a run's layers eager on any device ('' where it compiles them on a
    CUDA GPU): the one rule the run (model/kernels.compiles) and the memory plan (plan/planner) share."""
    if cfg.model.liger_kernels:
        return "Liger's kernels replace the layers' parts (model.liger_kernels)"
    if cfg.model.lora.load_in != "none":
        return f"a quantised base (model.lora.load_in={cfg.model.lora.load_in}): {QUANTISED_EAGER}"
    if cfg.parallel.expert > 1:
        return f"expert parallelism (parallel.expert={cfg.parallel.expert}): {EXPERTS_EAGER}"
    return ""
