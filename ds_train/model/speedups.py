"""The speed-ups a run turns on that replace part of the model's own forward, as one settled value:
what the config asks for (`configured`), then what the start-up probe (ds_train/train/probe.py) kept of
it after running each one against the model's forward (Speedups.notes say what it turned off, and why).

- the tiled loss (train.loss_tile_tokens) and the fused loss (train.fused_loss): the head's logits
  computed tile by tile, times `head_factor`, what the model's forward does to its head's output (the
  probe measures it: 1 for most models, 1 / logits_scaling for Granite, logit_scale for Cohere, ...);
- the tiled MLP (train.mlp_tile_positions): DeepSpeed's TiledMLP on each decoder layer's MLP;
- compiled layers (model.compile): torch.compile of each decoder layer;
- Liger's kernels (model.liger_kernels, CUDA only): its RMSNorm, RoPE and SwiGLU MLP;
- Ulysses attention (parallel.sequence > 1): not switched here; the probe checks it, or refuses.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_train.config import RunConfig
from ds_train.model.kernels import compiles


@dataclass(frozen=True)
class Speedups:
    loss_tile_tokens: int  # 0: the loss from the model's own logits
    fused_loss: bool
    mlp_tile_positions: int  # 0: every MLP whole
    compile: bool
    liger: bool  # asked for: model.kernels.apply_liger says where they cannot run
    head_factor: float = 1.0  # the model's logits are this times its head's output (measured by the probe)
    notes: tuple[str, ...] = ()  # what the probe turned off, and why (said at start-up)
    probed: str = ""  # what the probe checked, in one line (each rank's log)


def configured(cfg: RunConfig, device_type: str) -> Speedups:
    """What the config turns on, on this device (the probe not yet run)."""
    t, m = cfg.train, cfg.model
    return Speedups(loss_tile_tokens=t.loss_tile_tokens, fused_loss=t.fused_loss and bool(t.loss_tile_tokens),
                    mlp_tile_positions=t.mlp_tile_positions, compile=compiles(cfg, device_type),
                    liger=m.liger_kernels)
