"""The MLP in tiles for long sequences (train.mlp_tile_positions): DeepSpeed's TiledMLP.

A decoder layer's MLP holds the largest activations of a long sequence (gate, up, their product:
about 3 x intermediate values a token, 3.5x the hidden size for Llama). Tiled, each MLP keeps only
its input: the forward runs tile by tile without autograd, and the backward recomputes it tile
by tile (DeepSpeed's `TiledMLP`, which also holds ZeRO's gradient reduction until the last tile).
The same sums in another order: the loss and the gradients match the untiled MLP's (tests).
"""

from __future__ import annotations

import math
import types


def tiled_mlps(model, tile_positions: int, rank_positions: int) -> tuple[list[str], list[str]]:
    """Tile the MLP of every decoder layer (a module named `mlp` whose class ends in `MLP`) when a
    rank holds more than `tile_positions` positions of a sequence (`rank_positions`: seq_len /
    parallel.sequence); a tile holds that many positions of every sequence of the micro-batch.
    Returns the class names tiled and those left whole, with why (an MLP with dropout: its
    recomputation would draw other masks). Nothing to tile: ([], [])."""
    if not tile_positions or rank_positions <= tile_positions:
        return [], []
    shards = math.ceil(rank_positions / tile_positions)
    tiled, whole = set(), set()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "mlp" or not type(module).__name__.endswith("MLP"):
            continue
        dropout = max((m.p for m in module.modules() if type(m).__name__.startswith("Dropout")), default=0.0)
        if dropout:
            whole.add(f"{type(module).__name__} (dropout p={dropout} would differ in the recomputation)")
            continue
        _tile(module, shards)
        tiled.add(type(module).__name__)
    return sorted(tiled), sorted(whole)


def _tile(mlp, shards: int) -> None:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    own = vars(mlp).get("forward")  # an instance's own forward (model.liger_kernels' SwiGLU), else the class's
    whole = own.__func__ if own is not None else type(mlp).forward
    params = list(mlp.parameters())

    def forward(self, x):
        # TiledMLP splits along the sequence (dim -2): at most one position per tile.
        return TiledMLP.apply(whole, self, x, min(shards, x.shape[-2]), params)

    mlp.forward = types.MethodType(forward, mlp)
