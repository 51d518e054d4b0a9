"""What makes the model's own compute faster: Liger's Triton kernels (model.liger_kernels) and
torch.compile of each decoder layer (model.compile).

Liger's kernels replace the model's RMSNorm, RoPE and SwiGLU MLP.
liger-kernel (`pip install liger-kernel`) patches a Hugging Face model in place: each RMSNorm and
MLP instance gets Liger's forward, and the model type's module-level rotary function Liger's. Its
loss kernels are not used: ds_train's loss (ds_train/train/losses.py) is already fused in tiles. Where the
kernels cannot run (no CUDA device, the package missing, a model type Liger does not cover) the run
goes on without them, and one line says why.
"""

from __future__ import annotations

from ds_train.config.model import eager_layers
from ds_train.model.lora import base_model

# Liger's own switches: its cross-entropy and fused linear cross-entropy stay off (ds_train computes the loss).
LIGER = dict(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)


def apply_liger(model, device_type: str) -> tuple[bool, str]:
    """Patch `model` (a PEFT model: its base) with Liger's kernels. Returns whether it did, and the
    line that says what was done or why not."""
    if device_type != "cuda":
        return False, (f"model.liger_kernels: Liger's kernels are Triton kernels for a CUDA GPU, and this run is on "
                       f"{device_type}; it goes on without them")
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance
    except ImportError as e:
        return False, (f"model.liger_kernels: liger-kernel cannot be imported ({e}); `pip install liger-kernel`, or "
                       f"set model.liger_kernels=false; the run goes on without them")
    base = base_model(model)
    model_type = getattr(base.config, "model_type", "")
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return False, (f"model.liger_kernels: Liger has no kernels for model_type {model_type!r}; the run goes on "
                       f"without them")
    _apply_liger_kernel_to_instance(base, **LIGER)
    return True, f"model.liger_kernels: Liger's RMSNorm, RoPE and SwiGLU kernels on {model_type}"


def compile_layers(model, backend: str) -> tuple[int, str]:
    """torch.compile each decoder layer (each module of a class the model names in `_no_split_modules`,
    as torchtitan compiles each block), not the whole model: the layers share one compiled graph, and
    the loss (whose head returns the tiled loss for one forward at a time) stays eager, where a
    whole-model graph would be compiled again for every micro-batch. A model naming no layer class
    is compiled whole. Returns how many modules were compiled and their class."""
    import deepspeed.utils.nvtx

    # As DeepSpeed's own engine.compile does: its NVTX ranges wrap ZeRO-3's module hooks, which dynamo
    # would trace and compile again for each module class inside a layer (up to its recompile limit).
    deepspeed.utils.nvtx.enable_nvtx = False
    base = base_model(model)
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in base.modules() if type(m).__name__ in names]
    for layer in layers or [base]:
        layer.compile(backend=backend)
    return len(layers) or 1, type(layers[0]).__name__ if layers else type(base).__name__


def compiles(cfg, device_type: str) -> bool:
    """model.compile: true, false, or auto: on a CUDA GPU (where it measured 1.39x eager's tokens/s),
    unless the layout leaves the layers eager (config.model.eager_layers: Liger's kernels, a quantised
    base, expert parallelism; true is refused with the last two when the config is checked)."""
    choice = cfg.model.compile
    return choice is True or (choice == "auto" and device_type == "cuda" and not eager_layers(cfg))
