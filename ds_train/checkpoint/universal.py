"""DeepSpeed's universal checkpoint, and a checkpoint's weights made whole: where a tag's universal
copy lives (`universal_dir`), DeepSpeed's ds_to_universal run on a tag, the fp32 weights read back
from a universal checkpoint, and a ZeRO-0 AutoTP checkpoint's shards merged without it (ZeRO-0 has
no optimizer partitions for ds_to_universal to convert).
"""

from __future__ import annotations

import re
from pathlib import Path

from ds_train.errors import UserError

UNIVERSAL_SUFFIX = "_universal"


def universal_dir(tag_dir: Path) -> Path:
    return tag_dir.with_name(tag_dir.name + UNIVERSAL_SUFFIX)


def ds_to_universal(tag_dir: Path, out: Path) -> None:
    """DeepSpeed's ds_to_universal, `tag_dir` into `out`: every parameter whole in its own file
    (zero/<name>/fp32.pt), the ZeRO partitions and AutoTP shards merged; one line when it fails."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
           "--output_folder", str(out), "--num_extract_workers", "2", "--num_merge_workers", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise UserError(f"{tag_dir}: DeepSpeed's ds_to_universal failed: {last}")


def universal_state_dict(universal: Path) -> dict:
    """The whole fp32 weights of a universal checkpoint (what ds_to_universal wrote): a dict with the
    tensor under "param" per parameter, except that a ZeRO-3 conversion writes the other parameters as
    flat tensors, whose shapes its copied model-states files keep (as DeepSpeed's own loader reads them)."""
    import torch

    out, shapes = {}, None
    for p in sorted((universal / "zero").iterdir()):
        if not (p / "fp32.pt").is_file():
            continue
        saved = torch.load(p / "fp32.pt", map_location="cpu", weights_only=False)
        if isinstance(saved, dict):
            out[p.name] = saved["param"]
            continue
        shapes = _zero3_shapes(universal) if shapes is None else shapes
        if p.name not in shapes:
            raise UserError(f"{universal}: no shape for the flat tensor of {p.name!r} in its model-states files; "
                            f"convert the tag again (ds-train convert --to universal)")
        out[p.name] = saved.view(shapes[p.name])
    return out


def _zero3_shapes(universal: Path) -> dict:
    """Every parameter's shape, from the ZeRO-3 model-states files ds_to_universal copied beside zero/."""
    import torch

    shapes = {}
    for f in sorted(universal.glob("zero_pp_rank_*_model_states.pt")):
        saved = torch.load(f, map_location="cpu", mmap=True, weights_only=False)
        for group in saved.get("param_shapes") or []:
            shapes.update({name: tuple(shape) for name, shape in group.items()})
    return shapes


def module_buffers(tag_dir: Path) -> dict:
    """The persistent buffers of a tag (DeepSpeed saves them whole in every model-states file, under every
    ZeRO stage; a universal conversion carries parameters only): for instance DeepSeek-V3's router bias."""
    import torch

    files = sorted(tag_dir.glob("*mp_rank_00_model_states.pt"))
    files = [f for f in files if not f.name.startswith(("layer_", "expert_"))]
    if not files:
        return {}
    saved = torch.load(files[0], map_location="cpu", mmap=True, weights_only=False)
    module = saved.get("module") or {}
    return {name: module[name].clone() for name in saved.get("buffer_names") or [] if name in module}


def tensor_module_state_dict(tag_dir: Path, tensor: int) -> dict:
    """The whole weights of a ZeRO-0 AutoTP checkpoint (no optimizer partitions, so no ds_to_universal):
    each tensor rank's mp_rank_XX_model_states.pt holds its shards, put together by the affine map
    AutoTP saved for every parameter (DeepSpeed's own ParamAffineMap.rebuild). A tied alias keeps its
    parameter; anything else without a map must be the same on every rank."""
    import torch
    from deepspeed.checkpoint.affine import ParamAffineMap
    from deepspeed.checkpoint.constants import AFFINE_MAP, AFFINE_MAP_PARAMS, UNIVERSAL_CHECKPOINT_INFO

    files = [tag_dir / f"mp_rank_{r:02d}_model_states.pt" for r in range(tensor)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UserError(f"{tag_dir}: {', '.join(missing)} not found; a parallel.tensor={tensor} ZeRO-0 checkpoint "
                        f"has one model-states file per tensor rank")
    # mmap: the optimizer state in the same files is never read into memory.
    saved = [torch.load(f, map_location="cpu", mmap=True, weights_only=False) for f in files]
    maps = ((saved[0].get(UNIVERSAL_CHECKPOINT_INFO) or {}).get(AFFINE_MAP) or {}).get(AFFINE_MAP_PARAMS, {})
    modules = [s["module"] for s in saved]
    out, seen = {}, {}
    for name, first in modules[0].items():
        ptr = first.untyped_storage().data_ptr()
        pattern = next((p for p in maps if re.match(p, name)), None)
        if pattern is not None:
            out[name] = ParamAffineMap.from_dict(maps[pattern]).rebuild({r: m[name] for r, m in enumerate(modules)})
        elif ptr in seen:  # a tied weight saved under a second name
            out[name] = out[seen[ptr]]
        elif all(m[name].shape == first.shape and torch.equal(m[name], first) for m in modules[1:]):
            out[name] = first
        else:
            raise UserError(f"{tag_dir}: {name!r} differs across the tensor ranks and AutoTP saved no map for it; "
                            f"this checkpoint cannot be merged (train with ZeRO-1/2 and use ds-train convert)")
        seen.setdefault(ptr, name)
    return {k: v.float() if v.is_floating_point() else v for k, v in out.items()}
