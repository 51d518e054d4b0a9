"""Builds the Hugging Face causal LM (from a local directory or from an architecture). No distributed code.

Under ZeRO-3 a live `HfDeepSpeedConfig` makes transformers construct the model inside
`deepspeed.zero.Init`, so no rank ever holds the whole model (USERS.md trap 6: CPU OOM at load).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ds_train.config import ModelConfig
from ds_train.errors import UserError

# What transformers raises for a config or an architecture it rejects (its strict-dataclass
# validators raise huggingface_hub's StrictDataclassError, which is none of these: added below).
HF_REJECTS = (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError, ImportError)


def resolve_dtype(choice: str, device_type: str, bf16_supported: bool) -> str:
    """auto -> bf16 on a GPU that supports it, else fp32 (bf16 matmuls are slow on most CPUs).
    A precision this device cannot train in is an error here, before DeepSpeed's engine says so."""
    if choice == "fp16" and device_type == "cpu":
        raise UserError("model.dtype: fp16 is not supported on the CPU (DeepSpeed's CPU accelerator has no "
                        "fp16); use model.dtype=fp32 or bf16 there (auto picks fp32)")
    if choice == "bf16" and device_type == "cuda" and not bf16_supported:  # pre-Ampere GPUs
        raise UserError("model.dtype: bf16 is not supported on this GPU; use model.dtype=fp16 or fp32 (auto "
                        "picks fp32 there)")
    if choice != "auto":
        return choice
    return "bf16" if device_type == "cuda" and bf16_supported else "fp32"


def _said(e: BaseException, limit: int = 300) -> str:
    """What transformers said, on one line: the validator's own error rather than its wrapper."""
    cause = e.__cause__ if type(e).__name__.startswith("StrictDataclass") and e.__cause__ else e
    said = " ".join(str(cause).split()).rstrip(".")
    if not isinstance(cause, ValueError) or not said:  # KeyError('gelux') says only 'gelux'
        said = f"{type(cause).__name__}: {said}" if said else type(cause).__name__
    return said if len(said) <= limit else said[:limit] + "..."


def _rejects() -> tuple[type[BaseException], ...]:
    from huggingface_hub.errors import StrictDataclassError

    return (*HF_REJECTS, StrictDataclassError)


def config_class(model_type: str):
    """transformers' config class of `model_type`; an unknown one suggests the closest types."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=3, cutoff=0.6)
        hint = (f"did you mean {' or '.join(map(repr, close))}?" if close else
                "use one of transformers' model types, for example llama, mistral, qwen2 or gpt2")
        raise UserError(f"model.config.model_type: {model_type!r} is not a Hugging Face model type; {hint}")
    return CONFIG_MAPPING[model_type]


def check_causal_lm(model_type: str, where: str) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"{where}: model_type {model_type!r} has no causal LM in transformers "
                        f"(AutoModelForCausalLM); choose a decoder model type, for example llama")


def unknown_config_keys(model_type: str, given: dict, built) -> list[str]:
    """The keys of `given` that `built` (its config) kept as stray attributes: keys the default
    config of `model_type` does not have. transformers accepts any key, so a misspelt one
    (hidden_sizee) would be silently unused. Keys it consumes (rope_theta, torch_dtype) are not kept."""
    default = config_class(model_type)()
    known = set(default.to_dict()) | set(default.attribute_map)
    stored = set(built.to_dict())
    return [key for key in given if key not in known and key in stored]


def check_config_keys(model_type: str, given: dict, built) -> None:
    """A UserError naming every misspelt model.config key with the closest valid key."""
    import inspect

    unknown = unknown_config_keys(model_type, given, built)
    if not unknown:
        return
    cls = config_class(model_type)
    default = cls()
    params = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "kwargs")]
    valid = sorted({*default.to_dict(), *default.attribute_map, *params} - {"model_type"})
    valid = [k for k in valid if not k.startswith("_")]
    problems = []
    for key in unknown:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        fix = f" (did you mean {close[0]!r}?)" if close else "; remove it"
        problems.append(f"model.config.{key}: unknown key for {cls.__name__} (model_type {model_type}), "
                        f"which Hugging Face would leave unused{fix}")
    raise UserError("; ".join(problems))


def check_buildable(hf, attn_implementation: str, where: str) -> None:
    """Build the model on the meta device (no memory, ~0.1 s even for 70B) so that an architecture
    transformers cannot build fails here, before anything is written, naming `where` it came from."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    check_causal_lm(hf.model_type, where)
    if is_deepspeed_zero3_enabled():  # a live HfDeepSpeedConfig would build it inside zero.Init
        return

    def build(impl: str) -> BaseException | None:
        try:
            with torch.device("meta"):
                AutoModelForCausalLM.from_config(hf, attn_implementation=impl)
        except _rejects() as e:
            return e
        return None

    error = build(attn_implementation)
    if error is None:
        return
    if attn_implementation != "eager" and build("eager") is None:
        raise UserError(f"model.attn_implementation: {attn_implementation!r} cannot be used here "
                        f"({_said(error, 150)}); use sdpa or eager")
    raise UserError(f"{where}: Hugging Face cannot build the {hf.model_type} model from it ({_said(error)}); "
                    f"fix it")


def build_hf_config(model_cfg: ModelConfig, vocab_size: int, seq_len: int):
    """The transformers config, with vocab_size taken from the tokenizer unless set explicitly.

    Everything about the model that can fail is checked here, before anything is written: the
    config's keys and values, that the architecture builds, and model.path's weights are finite."""
    from transformers import AutoConfig

    if model_cfg.path:
        where = f"model.path: {str(Path(model_cfg.path) / 'config.json')!r}"
        try:
            hf = AutoConfig.from_pretrained(model_cfg.path)
        except _rejects() as e:
            raise UserError(f"{where}: Hugging Face rejects it ({_said(e)}); fix it, or re-export / "
                            f"re-download the model directory") from None
    else:
        where = "model.config"
        kwargs = dict(model_cfg.config)
        model_type = kwargs.pop("model_type")
        config_class(model_type)
        check_causal_lm(model_type, "model.config")
        kwargs.setdefault("vocab_size", vocab_size)
        try:
            hf = AutoConfig.for_model(model_type, **kwargs)
        except _rejects() as e:
            raise UserError(f"model.config: Hugging Face rejects it: {_said(e)}; fix model.config") from None
        check_config_keys(model_type, model_cfg.config, hf)
    max_pos = getattr(hf, "max_position_embeddings", None)
    if max_pos is not None and seq_len > max_pos:
        raise UserError(f"train.seq_len={seq_len} exceeds the model's max_position_embeddings="
                        f"{max_pos}; lower train.seq_len or raise model.config.max_position_embeddings")
    check_buildable(hf, model_cfg.attn_implementation, where)
    if model_cfg.path and has_weights(Path(model_cfg.path)):  # a ds_train run's hf_model/ has none
        check_finite_weights(Path(model_cfg.path))
    return hf


# --- model.path: config.json and the weights, checked before anything is written ------------------

REFETCH = "re-export or re-download the model directory"
# What from_pretrained reads, in its order of preference: one file, else the shards of an index.
WEIGHT_FILES = (("model.safetensors", "model.safetensors.index.json"),
                ("pytorch_model.bin", "pytorch_model.bin.index.json"))


def _json_object(path: Path) -> dict:
    """A UTF-8 JSON object from `path`, else a UserError naming the file and the fix."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        problem = "not UTF-8 text"
    except json.JSONDecodeError as e:
        problem = f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
    except OSError as e:
        problem = f"unreadable ({e.strerror or e})"
    else:
        if isinstance(value, dict):
            return value
        problem = f"a JSON {type(value).__name__}, not an object"
    raise UserError(f"model.path: {str(path)!r} is {problem}; {REFETCH}")


def has_weights(model_dir: Path) -> bool:
    return any((model_dir / name).exists() for pair in WEIGHT_FILES for name in pair)


def weight_files(model_dir: Path) -> list[Path]:
    """The files from_pretrained would read from `model_dir` (the shards of an index, which must all
    be there); a UserError when there are none."""
    for single, index in WEIGHT_FILES:
        if (model_dir / single).exists():
            return [model_dir / single]
        if (model_dir / index).exists():
            weight_map = _json_object(model_dir / index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise UserError(f"model.path: {str(model_dir / index)!r} has no weight_map; {REFETCH}")
            shards = [model_dir / name for name in sorted(set(map(str, weight_map.values())))]
            missing = [p.name for p in shards if not p.is_file()]
            if missing:
                are = "is" if len(missing) == 1 else "are"
                raise UserError(f"model.path: {str(model_dir / index)!r} names {_some(missing)}, which {are} "
                                f"not in {str(model_dir)!r}; {REFETCH}")
            return shards
    raise UserError(f"model.path: {str(model_dir)!r} holds no weights (model.safetensors, "
                    f"model.safetensors.index.json and its shards, or pytorch_model.bin); {REFETCH}")


def _open_weights(path: Path):
    """safetensors' reader (its header checked against the file's size) or torch's, memory-mapped."""
    import torch
    from safetensors import SafetensorError, safe_open

    try:
        if path.suffix == ".safetensors":
            return safe_open(str(path), "pt")
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (SafetensorError, OSError, RuntimeError, ValueError, EOFError) as e:
        said = " ".join(str(e).split())[:200] or type(e).__name__
        empty = " (empty)" if path.is_file() and path.stat().st_size == 0 else ""
        raise UserError(f"model.path: {str(path)!r}{empty} is not a whole weights file ({said}); "
                        f"{REFETCH}") from None


def check_model_dir(model_dir: Path, weights: bool = True) -> None:
    """A Hugging Face model directory: config.json is a JSON object transformers accepts, and every
    weights file opens (headers only: cheap). Writes nothing."""
    from transformers import AutoConfig

    _json_object(model_dir / "config.json")
    try:
        AutoConfig.from_pretrained(model_dir)
    except _rejects() as e:
        raise UserError(f"model.path: {str(model_dir / 'config.json')!r}: Hugging Face rejects it "
                        f"({_said(e)}); fix it, or re-export / re-download the model directory") from None
    for path in weight_files(model_dir) if weights else ():
        _open_weights(path)


def _named_tensors(path: Path) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of every tensor in a weights file, one at a time."""
    reader = _open_weights(path)
    if path.suffix != ".safetensors":
        yield from reader.items()
        return
    for name in reader.keys():
        yield name, reader.get_tensor(name)


def nonfinite_tensors(named: Iterator[tuple[str, Any]]) -> list[str]:
    """The names of the floating-point tensors holding a NaN or an infinity."""
    import torch

    return [name for name, t in named if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def check_finite_weights(model_dir: Path) -> None:
    """model.path's weights hold no NaN or inf (training on them would fail later with a misleading
    loss): read once, tensor by tensor, before the model is built."""
    bad = [name for path in weight_files(model_dir) for name in nonfinite_tensors(_named_tensors(path))]
    if bad:
        raise UserError(f"model.path {str(model_dir)!r}: {_tensors(len(bad))} hold NaN or inf values "
                        f"({_some(bad)}); the weights are damaged: {REFETCH}")


@dataclass
class BuiltModel:
    model: Any
    hf_config: Any
    ds_hf_config: Any  # keeps HfDeepSpeedConfig alive while the engine is built (ZeRO-3)
    new_weights: tuple[str, ...] = ()  # initialised, not loaded: missing from model.path (allow_new_weights)


def _some(keys, limit: int = 5) -> str:
    """`a, b, c` or `a, ..., e and 3 more`: enough keys to recognise the problem on one line."""
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return f"{shown} and {len(keys) - limit} more" if len(keys) > limit else shown


def _tensors(n: int) -> str:
    return f"{n} tensor{'' if n == 1 else 's'}"


def check_loading_info(path: str, model_type: str, info: dict, allow_new_weights: bool) -> tuple[str, ...]:
    """The tensors to report as newly initialised, or a UserError when model.path's weights do not fit.

    `info` is what `from_pretrained(..., output_loading_info=True)` returns. Missing tensors are
    initialised at random and unexpected ones dropped, with only a logged warning; here both are
    errors, except missing tensors under model.allow_new_weights (a new head). Tied weights (an
    lm_head sharing the embeddings) are already taken off `missing_keys` by transformers.
    """
    arch = f"the {model_type} architecture" if model_type else "the architecture"
    problems = []
    if info.get("mismatched_keys"):
        shapes = [f"{key} {list(ckpt)} vs {list(model)}" for key, ckpt, model in info["mismatched_keys"]]
        problems.append(f"the weights hold {_tensors(len(shapes))} of other shapes than {arch} needs "
                        f"(saved vs needed: {_some(shapes)}); "
                        f"the weights do not match config.json: fix config.json or the directory "
                        f"(model.allow_new_weights does not cover changed shapes)")
    if info.get("unexpected_keys"):
        unexpected = info["unexpected_keys"]
        problems.append(f"the weights hold {_tensors(len(unexpected))} {arch} does not use "
                        f"({_some(unexpected)}): config.json does not describe these weights; "
                        f"fix config.json or remove them from the directory")
    missing = info.get("missing_keys") or ()
    if missing and not allow_new_weights:
        problems.append(f"the weights lack {_tensors(len(missing))} {arch} needs ({_some(missing)}); "
                        f"the weights do not match config.json: fix the directory, or set "
                        f"model.allow_new_weights=true to initialise them (a new head)")
    if problems:
        raise UserError(f"model.path {path!r}: " + "; also ".join(problems))
    return tuple(sorted(missing))


def seeded_init(model, seed: int, zero3: bool) -> None:
    """Re-initialise each module with the model's own `_init_weights`, seeded by the module's name.

    The weights then depend on the seed alone, not on how construction consumed the RNG, so ZeRO-3
    (built inside zero.Init) starts from the same weights as ZeRO 0-2 and any world size.
    """
    import zlib
    from contextlib import nullcontext

    import deepspeed
    import torch

    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        gather = deepspeed.zero.GatheredParameters(params, modifier_rank=0) if zero3 else nullcontext()
        with gather, torch.no_grad():
            torch.manual_seed(seed + zlib.crc32(name.encode()))
            model._init_weights(module)


def build_model(model_cfg: ModelConfig, hf_config, ds_config: dict, seed: int = 0) -> BuiltModel:
    """Construct (ZeRO-3: partitioned) the model in fp32; the engine casts to bf16/fp16."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.utils import logging as hf_logging

    # Its "Loading weights" bar goes to stderr on every rank: an error would no longer be one line.
    hf_logging.disable_progress_bar()
    keep_alive = None
    zero3 = ds_config.get("zero_optimization", {}).get("stage", 0) == 3
    if zero3:
        keep_alive = HfDeepSpeedConfig(ds_config)
    kwargs = dict(attn_implementation=model_cfg.attn_implementation, dtype=torch.float32)
    new_weights: tuple[str, ...] = ()
    if model_cfg.path:
        # ignore_mismatched_sizes: without it transformers raises a multi-line RuntimeError on a
        # shape mismatch before returning the loading info; check_loading_info rejects them anyway.
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                model_cfg.path, config=hf_config, output_loading_info=True, ignore_mismatched_sizes=True,
                **kwargs)
        except (SafetensorError, OSError, EOFError) as e:  # build_hf_config checked them; changed since?
            raise UserError(f"model.path {model_cfg.path!r}: cannot load the weights ({_said(e)}); "
                            f"{REFETCH}") from None
        # Under ZeRO-3 (transformers 5.x, _load_pretrained_model) only missing_keys is filled in:
        # unexpected and mismatched come back empty, and a shape mismatch raises on rank 0 alone.
        new_weights = check_loading_info(model_cfg.path, getattr(hf_config, "model_type", ""), info,
                                         model_cfg.allow_new_weights)
    else:
        try:
            model = AutoModelForCausalLM.from_config(hf_config, **kwargs)
        except (ValueError, TypeError, KeyError) as e:  # check_buildable ran without ZeRO-3's zero.Init
            raise UserError(f"model.config: Hugging Face cannot build the model ({_said(e)}); "
                            f"fix model.config") from None
        seeded_init(model, seed, zero3)
    if model_cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return BuiltModel(model, hf_config, keep_alive, new_weights)


def count_params(model) -> int:
    """Parameter count, also when ZeRO-3 has partitioned the tensors away (ds_numel)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


def flops_per_token(n_params: int, n_layers: int, hidden: int, seq_len: int, lookups: int = 0) -> float:
    """Training FLOPs per token: 6N for the matmuls plus 12 L h s for attention (PaLM, App. B).
    N leaves out `lookups`, the parameters of an input embedding that is only indexed (torchtitan's
    count; see lookup_params)."""
    return 6 * (n_params - lookups) + 12 * n_layers * hidden * seq_len


def lookup_params(hf_config) -> int:
    """Parameters that do no matmul: the input embedding when it is not tied to the output head (a
    tied matrix does the head's matmul, so it counts once)."""
    if getattr(hf_config, "tie_word_embeddings", False):
        return 0
    return int(getattr(hf_config, "vocab_size", 0) or 0) * int(getattr(hf_config, "hidden_size", 0) or 0)


def supports_packing(hf_config) -> bool:
    """Whether the model keeps packed examples apart given position ids that restart at each one:
    its modeling code builds its attention mask with transformers' masking_utils, which finds the
    packed sequences in position_ids (for eager, sdpa, flex and flash attention alike)."""
    import inspect
    import sys

    from transformers import AutoModelForCausalLM

    try:
        cls = AutoModelForCausalLM._model_mapping[type(hf_config)]
    except (KeyError, AttributeError):
        return False
    module = sys.modules.get(cls.__module__)
    return (hasattr(module, "create_causal_mask")
            and "position_ids" in inspect.signature(cls.forward).parameters)
