"""A complete, loadable Hugging Face directory from a ds_train checkpoint (USERS.md trap 5).

    ds-train export RUN_DIR --out OUT [--tag step_00000100] [--max-shard-size 5GB]

DeepSpeed's zero_to_fp32.py writes weights only; the run recorded config.json,
generation_config.json and the tokenizer in `<run_dir>/hf_model/`, and export adds the weights:
safetensors in the run's dtype (model.dtype as the run resolved it, recorded in every checkpoint: a bf16 run's
export is bf16, the copy the run scored lm-eval's tasks on, ds_train/train/benchmarks.py), sharded above
`max_shard_size`; config.json's `dtype` records it, so `lm_eval --model hf` with no dtype scores it as the run
did. ZeRO 1-3 weights are DeepSpeed's fp32 master
copy, consolidated by its own `get_fp32_state_dict_from_zero_checkpoint`; ZeRO 0 has no optimizer
partitions, so its weights are the `module` entry of `mp_rank_00_model_states.pt`. AutoTP's shards and
AutoEP's experts are gathered by DeepSpeed's universal conversion; AutoEP's router and experts then go
back under the model's own names and layout (ds_train/checkpoint/experts.py).

The process holds at most one full fp32 copy of the weights (and, for a bf16 or fp16 run, its half-size
cast): the model is built on the meta device and takes the checkpoint's tensors as they are
(`load_state_dict(assign=True)`), and the writer never clones them (see `save_weights`). The directory
is written under a temporary name beside `out` and renamed at the end, so a failed export leaves nothing behind, and an existing non-empty
`out` is never touched. An `out` inside a checkpoints directory or a tag, where retention prunes and
a resume reads, is refused before anything is written.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from ds_train.checkpoint import commit as checkpoint
from ds_train.checkpoint.experts import autoep_module_state_dict, autoep_specs, hf_layout
from ds_train.checkpoint.rundir import LATEST, RunPaths
from ds_train.checkpoint.tagfiles import holds_a_save
from ds_train.checkpoint.universal import (ds_to_universal, module_buffers, tensor_module_state_dict,
                                           universal_dir, universal_state_dict)
from ds_train.errors import UserError
from ds_train.fs import check_writable, write_atomic

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # a run's dtype -> torch's, config.json's


@dataclass(frozen=True)
class ExportSource:
    run_dir: Path  # the parent of checkpoints/; holds hf_model/
    ckpt_dir: Path  # the directory DeepSpeed saved into (holds `latest` and the tags)
    tag: str
    zero_stage: int
    tensor: int = 1  # parallel.tensor it was saved with: AutoTP shards to merge
    expert: int = 1  # parallel.expert it was saved with: AutoEP's experts to gather into the model's layout
    passed_over: str = ""  # what newer than `tag` was not taken, and why (said by the command); "" none
    dtype: str = "fp32"  # the run's precision it was saved with (bf16, fp16, fp32): the export's

    @property
    def tag_dir(self) -> Path:
        return self.ckpt_dir / self.tag


def _is_tag_dir(path: Path) -> bool:
    return bool(checkpoint.TAG_RE.match(path.name)) or (path / checkpoint.STATE_FILE).is_file()


def _normalise_tag(tag: str) -> str:
    """'8' means step_00000008; anything else is taken as a tag name."""
    return checkpoint.tag_for(int(tag)) if tag.isdigit() else tag


def resolve_source(source: str | Path, tag: str | None = None) -> ExportSource:
    """A run directory, its checkpoints/ directory, or a tag directory -> the complete tag to export."""
    src = Path(source)
    tag = _normalise_tag(tag) if tag is not None else None
    if not src.is_dir():
        raise UserError(f"export: {str(src)!r} is not a directory; give a run directory (output_dir), "
                        f"its checkpoints/ directory or a tag directory (checkpoints/step_00000100)")
    if RunPaths(src).checkpoints.is_dir():
        ckpt_dir, wanted = RunPaths(src).checkpoints, tag
    elif _is_tag_dir(src):
        ckpt_dir, wanted = src.parent, src.name
        if tag is not None and tag != src.name:
            raise UserError(f"export: {str(src)!r} is the tag {src.name}, but tag={tag!r} was asked "
                            f"for; give the run or checkpoints directory with a tag, or the tag directory "
                            f"alone")
    elif (src / LATEST).is_file() or any(checkpoint.TAG_RE.match(p.name) for p in src.iterdir()):
        ckpt_dir, wanted = src, tag
    else:
        raise UserError(f"export: {str(src)!r} holds no checkpoints (no checkpoints/, {LATEST} or step_* "
                        f"tags); give a run directory trained with checkpoint.every or checkpoint.save_final")

    if wanted is None:
        chosen = checkpoint.latest_complete(ckpt_dir)
        if chosen is None:
            raise UserError(f"export: {str(ckpt_dir)!r} holds no complete checkpoint (a save that did not "
                            f"finish leaves a tag without {checkpoint.STATE_FILE} or a rank file); "
                            f"train until a save completes, then export")
    else:
        chosen = wanted
        tag_dir = ckpt_dir / chosen
        complete = checkpoint.complete_tags(ckpt_dir)
        choices = f"complete tags: {', '.join(complete)}" if complete else "there are no complete tags"
        if not tag_dir.is_dir():
            raise UserError(f"export: no tag {chosen!r} in {str(ckpt_dir)!r}; {choices}")
        if not checkpoint.is_complete(tag_dir):
            raise UserError(f"export: {str(tag_dir)!r} is incomplete (a save that did not finish); "
                            f"export another tag ({choices})")
    state = json.loads((ckpt_dir / chosen / checkpoint.STATE_FILE).read_text())
    if state.get("universal"):  # checkpoint.convert_to_universal: per-parameter files, no ZeRO partitions
        source_tag = state.get("source_tag", "the tag it was converted from")
        raise UserError(f"export: {str(ckpt_dir / chosen)!r} is a universal checkpoint (converted from "
                        f"{source_tag} for a resume); export {str(ckpt_dir / source_tag)!r} instead")
    tensor = int((checkpoint.saved_parallel(state) or {}).get("tensor", 1))
    expert = int((checkpoint.saved_parallel(state) or {}).get("expert", 1))
    passed_over = _passed_over(ckpt_dir, chosen) if wanted is None else ""
    dtype = state.get("dtype") if state.get("dtype") in TORCH_DTYPES else "fp32"  # a marker before dtypes: fp32
    return ExportSource(ckpt_dir.parent, ckpt_dir, chosen, _zero_stage(state, ckpt_dir / chosen), tensor, expert,
                        passed_over, dtype)


def _passed_over(ckpt_dir: Path, chosen: str) -> str:
    """The newest complete tag was taken: the tags named after it (a higher step) that are not complete,
    and a `latest` that names another tag, said in a few words; "" when there are none."""
    step = int(checkpoint.TAG_RE.match(chosen).group(1))
    newer = sorted(p.name for p in ckpt_dir.iterdir() if (m := checkpoint.TAG_RE.match(p.name))
                   and int(m.group(1)) > step and p.is_dir() and holds_a_save(p) and not checkpoint.is_complete(p))
    said = [f"skipped {', '.join(newer)} (incomplete: a save that did not finish)"] if newer else []
    latest = checkpoint.read_latest(ckpt_dir)
    if latest and latest != chosen and latest not in newer:
        said.append(f"`latest` names {latest}, not the newest complete tag")
    return "; ".join(said)


def _zero_stage(state: dict, tag_dir: Path) -> int:
    """From ds_train_state.json; from the files for a state that predates the key."""
    if "zero_stage" in state:
        return int(state["zero_stage"])
    return 1 if any(tag_dir.glob("*_optim_states.pt")) else 0


def _check_out(out: Path) -> None:
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"export: {str(out)!r} exists and is not empty; export never overwrites: "
                        f"give a new directory or remove this one")
    if out.exists() and not out.is_dir():
        raise UserError(f"export: {str(out)!r} exists and is not a directory; give a new directory")


def _holds_checkpoints(folder: Path) -> bool:
    """A run's checkpoints/ (made yet or not), or any folder with `latest` or a tag that holds a save."""
    try:
        return (folder == RunPaths(folder.parent).checkpoints and RunPaths(folder.parent).config.is_file() or
                (folder / LATEST).is_file() or folder.is_dir() and any(
                    checkpoint.TAG_RE.match(p.name) and p.is_dir() and holds_a_save(p) for p in folder.iterdir()))
    except OSError:  # a folder we may not read holds no checkpoints of ours
        return False


def check_outside_checkpoints(out: Path) -> None:
    """An export never goes into a tag or a checkpoints directory: retention prunes there (and would
    see a tag's files mixed with the export's), a resume and `ds-train export` read there."""
    target = Path(os.path.abspath(out)).resolve()
    for folder in (target, *target.parents):
        if _holds_checkpoints(folder):
            raise UserError(f"export: --out {str(out)!r} is inside the checkpoints directory {str(folder)!r}, where "
                            f"checkpoint.keep prunes and a resume reads; export beside it, e.g. --out "
                            f"{str(folder.parent / 'hf_export')!r}")


def hf_metadata_dir(src: ExportSource) -> Path:
    hf_dir = RunPaths(src.run_dir).hf_model
    if not (hf_dir / "config.json").is_file():
        raise UserError(f"export: {str(hf_dir / 'config.json')!r} not found; export needs the run "
                        f"directory's {hf_dir.name}/ (the model config and tokenizer) beside "
                        f"checkpoints/: export from the run directory, or copy {hf_dir.name}/ there")
    return hf_dir


def save_hf_metadata(hf_config, tokenizer, out: Path) -> None:
    """config.json, generation_config.json and the tokenizer: what `ds-train export` adds weights to.

    Written beside `out` first, then moved in file by file: a crash leaves each file old or new.
    """
    import tempfile

    from transformers import GenerationConfig

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        hf_config.save_pretrained(tmp)
        GenerationConfig.from_model_config(hf_config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        out.mkdir(exist_ok=True)
        for path in Path(tmp).iterdir():
            os.replace(path, out / path.name)


def locate_model(path: str | Path) -> tuple[Path, Path | None]:
    """model.path -> (the directory with config.json and the tokenizer, and the ds_train run or
    checkpoint directory whose weights `export` must write first; None for a HF directory). What
    the directory holds is checked once, by ds_train.model.hfconfig.build_hf_config."""
    src = Path(path)
    if (src / "config.json").is_file():
        return src, None
    if not any(path.exists() for path in (RunPaths(src).checkpoints, src / LATEST, src / checkpoint.STATE_FILE)):
        raise UserError(f"model.path: {str(src)!r} is neither a Hugging Face directory (config.json) nor a "
                        f"ds_train run or checkpoint directory")
    try:
        hf_dir = hf_metadata_dir(resolve_source(src))
    except UserError as e:
        raise UserError(f"model.path: {str(e).removeprefix('export: ')}") from None
    return hf_dir, src


def load_fp32_state_dict(src: ExportSource, scratch: Path) -> dict:
    """The full fp32 weights of one tag: DeepSpeed's master copy for ZeRO 1-3, the module for ZeRO 0.
    AutoTP's shards and AutoEP's experts are gathered by DeepSpeed's universal conversion (its
    tensor-parallel patterns and expert maps say how), written under `scratch` and removed, unless a
    resume already converted the tag; under ZeRO-0 (no optimizer partitions to convert) from the
    module shards by AutoTP's saved maps, or from the module and AutoEP's per-expert files."""
    import torch

    if src.tensor > 1 and src.zero_stage == 0:
        return tensor_module_state_dict(src.tag_dir, src.tensor)
    if src.expert > 1 and src.zero_stage == 0:
        return autoep_module_state_dict(src.tag_dir)
    if src.tensor > 1 or src.expert > 1:
        universal = universal_dir(src.tag_dir)
        if not checkpoint.is_complete(universal):
            universal = scratch / src.tag  # ds_to_universal writes latest_universal beside it
            ds_to_universal(src.tag_dir, universal)
        try:
            return {**module_buffers(src.tag_dir), **universal_state_dict(universal)}
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    if src.zero_stage == 0:
        path = src.tag_dir / "mp_rank_00_model_states.pt"
        if not path.is_file():
            raise UserError(f"export: {str(path)!r} not found; {str(src.tag_dir)!r} is not a ZeRO-0 "
                            f"DeepSpeed checkpoint")
        # mmap: the optimizer state in the same file is never read into memory.
        saved = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        return {k: v.float() if v.is_floating_point() else v for k, v in saved["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(src.ckpt_dir), tag=src.tag)


def build_model(hf_dir: Path, state_dict: dict, where: Path):
    """The model on the meta device, then given the checkpoint's tensors without a copy."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    # build_model turns the KV cache off for training and the run records that config; an
    # exported model is for inference, where generate() without the cache is quadratic.
    config.use_cache = True
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mismatch = (f"export: the weights in {str(where)!r} do not fit {str(hf_dir / 'config.json')!r}"
                f" (was hf_model/ copied from another run?)")
    try:
        result = model.load_state_dict(state_dict, strict=False, assign=True)
    except RuntimeError as e:  # size mismatch, listed per parameter by torch
        raise UserError(f"{mismatch}: {' '.join(str(e).split())[:300]}") from None
    model.tie_weights()  # lm_head.weight is absent (or a second name) when tie_word_embeddings
    missing = [k for k, v in model.state_dict().items() if v.is_meta]
    if result.unexpected_keys or missing:
        raise UserError(f"{mismatch}: unexpected {sorted(result.unexpected_keys)[:5]}, "
                        f"missing {missing[:5]}")
    return model


def model_layout(hf_dir: Path, state: dict) -> dict:
    """An expert-parallel checkpoint's weights (AutoEP's names) in the model's own layout."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return hf_layout(state, autoep_specs(model, config), {k: v.shape for k, v in model.state_dict().items()})


def _check_shard_size(max_shard_size: str) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    try:
        split_torch_state_dict_into_shards({}, max_shard_size=max_shard_size)
    except ValueError:
        raise UserError(f"export: max_shard_size={max_shard_size!r} is not a size; write it like "
                        f"5GB, 500MB or 100KB") from None


def save_weights(model, out: Path, max_shard_size: str) -> None:
    """model.safetensors, or shards and model.safetensors.index.json above `max_shard_size`.

    Not `model.save_pretrained`: it clones every tensor that shares a storage with another, and
    DeepSpeed's ZeRO 1/2 consolidation returns all weights as views into one flat fp32 vector, so
    it would hold a second full copy (measured: +0.42 GB for a 0.54 GB model). safetensors writes
    disjoint views as they are; shard sizes come from meta stand-ins so that the shared storage is
    not mistaken for tied weights (which would put everything in one shard).
    """
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    tensors, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:  # tied weights are one Parameter: saved once, under the first name
            seen.add(id(tensor))
            tensors[name] = tensor.detach()
    stand_ins = {name: torch.empty_like(t, device="meta") for name, t in tensors.items()}
    split = split_torch_state_dict_into_shards(stand_ins, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n].contiguous() for n in names}, out / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        write_atomic(out / "model.safetensors.index.json", json.dumps(index, indent=2, sort_keys=True) + "\n")


def save_config(model, hf_dir: Path, out: Path) -> None:
    """config.json as save_pretrained writes it: the architecture and the dtype of the weights (what
    `from_pretrained(dtype="auto")` and `lm_eval --model hf` with no dtype load them in). Where the
    model keeps a config AutoModelForCausalLM does not map (the text model of a multimodal config: Mllama,
    Emu3), the run's own config, from which it maps to the same model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = model.config
    if type(config) not in AutoModelForCausalLM._model_mapping:
        config = AutoConfig.from_pretrained(hf_dir)
    config.architectures = [type(model).__name__]
    floating = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    config.dtype = str(floating).removeprefix("torch.") if floating is not None else "float32"
    config.save_pretrained(out)


def in_dtype(model, dtype: str):
    """`model`'s floating-point weights in the run's `dtype` (bf16, fp16, fp32), cast in place; returns it."""
    import torch

    wanted = getattr(torch, TORCH_DTYPES[dtype])
    if any(p.is_floating_point() and p.dtype != wanted for p in model.parameters()):
        model.to(wanted)
    return model


def copy_metadata(hf_dir: Path, out: Path) -> None:
    """Tokenizer files and the recorded generation config (config.json is written by save_config)."""
    for path in sorted(hf_dir.iterdir()):
        if path.is_file() and path.name != "config.json" and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, out / path.name)


def _match_modes(out: Path) -> None:
    """safetensors writes 0600 files whatever the umask; give them config.json's (umask) mode."""
    mode = (out / "config.json").stat().st_mode & 0o777
    for path in out.glob("*.safetensors"):
        path.chmod(mode)


def export(source: str | Path, out: str | Path, tag: str | None = None, max_shard_size: str = "5GB") -> Path:
    """Write a Hugging Face model directory (safetensors in the run's dtype, config, tokenizer) to `out`.

    `source`: a run directory, its checkpoints/ directory or a tag directory; `tag`: a tag name
    (or a step number), else the latest complete tag. Returns `out`. Raises UserError on bad input.
    """
    src = resolve_source(source, tag)
    hf_dir = hf_metadata_dir(src)

    def fill(tmp: Path) -> None:
        state = load_fp32_state_dict(src, tmp / ".universal")
        if src.expert > 1:
            state = model_layout(hf_dir, state)
        write_model(build_model(hf_dir, state, src.tag_dir), hf_dir, tmp, max_shard_size, src.dtype)

    return write_dir(Path(out), fill, max_shard_size)


def write_model(model, hf_dir: Path, out: Path, max_shard_size: str, dtype: str = "fp32") -> None:
    """A Hugging Face model directory: the weights in `dtype` (the run's: ExportSource.dtype; a model in another
    is cast in place, rounding to nearest as the run's own copy was), config.json, the run's tokenizer and
    generation config."""
    in_dtype(model, dtype)
    save_weights(model, out, max_shard_size)
    save_config(model, hf_dir, out)
    copy_metadata(hf_dir, out)
    _match_modes(out)


def write_dir(out: Path, fill, max_shard_size: str = "5GB") -> Path:
    """`fill(tmp)` writes the export into a temporary directory beside `out`, renamed to `out` at the
    end: a failed export leaves nothing, an existing non-empty `out` is never touched. Every check
    comes before the weights are read."""
    check_outside_checkpoints(out)
    _check_out(out)
    # The export is written beside `out` and renamed over it: both must be writable.
    for path in (out, out.parent) if out.exists() else (out,):
        check_writable(path, "--out")
    _check_shard_size(max_shard_size)

    tmp = out.parent / f".{out.name}.export-{os.getpid()}-{secrets.token_hex(4)}"
    cannot_write = f"export: cannot write the export beside {str(out)!r}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise UserError(f"{cannot_write} ({e.strerror or e}); choose another --out") from None
    try:
        try:
            fill(tmp)
        except OSError as e:  # a full disk, a quota: nothing is left behind (tmp goes below)
            raise UserError(f"{cannot_write} ({e.strerror or e}); free space there or choose another "
                            f"--out") from None
        _check_out(out)  # again: something may have appeared while the weights were written
        try:
            os.replace(tmp, out)  # atomic; replaces only a missing or empty directory
        except OSError as e:
            raise UserError(f"export: cannot move the export into {str(out)!r}: {e.strerror}; give a new "
                            f"directory as --out") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
