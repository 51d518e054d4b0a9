"""`ds-train export` of a run that trained with LoRA (model.lora): its checkpoints hold the adapters
alone (the base is frozen and referenced by fingerprint), so the export puts the base back under them.

    ds-train export RUN_DIR --out adapter/            # peft: adapter_config.json, adapter_model.safetensors
    ds-train export RUN_DIR --out merged/ --merge     # one Hugging Face model, the adapters merged in

The base is model.path's weights (checked against the fingerprint the checkpoint recorded), the
model a ds_train run given as model.path was exported into (<run>/init_model), or for a model
trained from scratch the seeded initial weights, rebuilt from the run's config and seed and written
beside the adapter as base/ (what adapter_config.json's base_model_name_or_path names).
"""

from __future__ import annotations

import json
from pathlib import Path

from ds_train.checkpoint import commit as checkpoint
from ds_train.checkpoint.export import (ExportSource, hf_metadata_dir, copy_metadata, load_fp32_state_dict,
                                        in_dtype, locate_model, resolve_source, write_dir,
                                        write_model)
from ds_train.checkpoint.rundir import RunPaths
from ds_train.config.model import LoraConfig
from ds_train.errors import UserError
from ds_train.fs import write_atomic
from ds_train.model.build import from_scratch
from ds_train.model.lora import apply_lora
from ds_train.model.weights import fingerprint, weight_files


def run_lora(src: ExportSource) -> tuple[LoraConfig | None, dict]:
    """The LoRA settings the tag was trained with (None: every weight trained), and its marker."""
    state = checkpoint.read_marker(src.tag_dir)[0] or {}
    lora = ((state.get("config") or {}).get("model") or {}).get("lora") or {}
    if not lora.get("rank"):
        return None, state
    return LoraConfig(**{k: v for k, v in lora.items() if k in LoraConfig.__dataclass_fields__}), state


def base_dir(src: ExportSource, state: dict) -> Path | None:
    """The directory the run loaded its frozen base from (None: built from model.config and the seed),
    its weights checked against the fingerprint the checkpoint recorded."""
    path = ((state.get("config") or {}).get("model") or {}).get("path") or ""
    if not path:
        return None
    init_model = RunPaths(src.run_dir).init_model  # model.path was a ds_train run, exported once
    where = init_model if (init_model / "config.json").is_file() else locate_model(path)[0]
    saved = (state.get("data") or {}).get("base")
    if where is None or not where.is_dir():
        raise UserError(f"export: the LoRA base {path!r} (model.path of the run) is not a directory any more; "
                        f"put the base model back there")
    if saved and saved not in ("model.config",) and where != init_model and fingerprint(weight_files(where)) != saved:
        raise UserError(f"export: the base model's weights in {str(where)!r} changed since {src.tag} was saved "
                        f"(fingerprint {saved} -> {fingerprint(weight_files(where))}); its adapters were trained on "
                        f"the old base: put that base back at model.path")
    return where


def load_base(src: ExportSource, hf_dir: Path, state: dict):
    """The frozen base in fp32, as the run built it; and its directory (None: from model.config)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    base = base_dir(src, state)
    if base is not None:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    else:
        seed = int(state["config"].get("seed", 0))
        torch.manual_seed(seed)  # as the run built it: seed_all, then from_scratch
        model, _ = from_scratch(AutoConfig.from_pretrained(hf_dir), seed, False, dtype=torch.float32)
    model.config.use_cache = True  # an exported model is for inference (the run turned the cache off)
    return model, base


def attach_adapters(model, src: ExportSource, lora: LoraConfig, state: dict, scratch: Path):
    """peft's LoRA layers on `model`, holding the tag's trained adapters (DeepSpeed's fp32 copy)."""
    adapted = apply_lora(model, lora, int(state["config"].get("seed", 0)))
    trained = load_fp32_state_dict(src, scratch)
    expected = {n for n, p in adapted.named_parameters() if p.requires_grad}
    result = adapted.load_state_dict(trained, strict=False)
    missing = sorted(expected - set(trained))
    if result.unexpected_keys or missing:
        raise UserError(f"export: the adapters in {str(src.tag_dir)!r} do not fit model.lora of the run "
                        f"(unexpected {sorted(result.unexpected_keys)[:3]}, missing {missing[:3]})")
    empty = [n for n, t in trained.items() if t.numel() == 0]
    if empty:  # what ZeRO-3 holds of a partitioned tensor; DeepSpeed's consolidation gathers them
        raise UserError(f"export: {str(src.tag_dir)!r} holds zero-size adapter tensors ({empty[:3]})")
    return adapted


def export_lora(source: str | Path, out: str | Path, tag: str | None = None, merge: bool = False,
                max_shard_size: str = "5GB") -> Path:
    """The adapters as a peft directory (adapter_config.json, adapter_model.safetensors, the tokenizer),
    or (`merge`) the adapted model merged into one Hugging Face directory."""
    src = resolve_source(source, tag)
    hf_dir = hf_metadata_dir(src)
    lora, state = run_lora(src)
    if lora is None:
        raise UserError(f"export: {str(src.tag_dir)!r} was trained without LoRA (model.lora.rank=0); its "
                        f"export is a whole model already: drop --merge")
    out = Path(out)

    def fill(tmp: Path) -> None:
        model, base = load_base(src, hf_dir, state)
        if base is None and not merge:  # from scratch: the seeded base goes beside the adapter
            (tmp / "base").mkdir()
            write_model(model, hf_dir, tmp / "base", max_shard_size, src.dtype)
        adapted = attach_adapters(model, src, lora, state, tmp / ".universal")
        if merge:
            # merged in the run's dtype, base and adapters cast first: the weights the run itself merged and scored
            write_model(in_dtype(adapted, src.dtype).merge_and_unload(), hf_dir, tmp, max_shard_size, src.dtype)
            return
        adapted.peft_config["default"].base_model_name_or_path = str(base or tmp / "base")  # read while saving
        adapted.save_pretrained(tmp, safe_serialization=True)
        config = json.loads((tmp / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = str((base or out / "base").resolve())  # where it will be
        write_atomic(tmp / "adapter_config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
        copy_metadata(hf_dir, tmp)

    return write_dir(out, fill, max_shard_size)
