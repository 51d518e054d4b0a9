"""model.path's weights, checked before anything is written (every file whole, every tensor finite),
and after loading (the tensors the architecture needs, of the shapes it needs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from ds_train.errors import UserError

REFETCH = "re-export or re-download the model directory"
# What from_pretrained reads, in its order of preference: one file, else the shards of an index.
WEIGHT_FILES = (("model.safetensors", "model.safetensors.index.json"),
                ("pytorch_model.bin", "pytorch_model.bin.index.json"))


def json_object(path: Path, key: str = "model.path") -> dict:
    """A UTF-8 JSON object from `path`, else a UserError naming the file and the fix (`key`: what named it)."""
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
    raise UserError(f"{key}: {str(path)!r} is {problem}; {REFETCH}")


def weight_files(model_dir: Path, key: str = "model.path") -> list[Path]:
    """The files from_pretrained would read from `model_dir` (the shards of an index, which must all
    be there); a UserError naming `key` when there are none."""
    for single, index in WEIGHT_FILES:
        if (model_dir / single).exists():
            return [model_dir / single]
        if (model_dir / index).exists():
            weight_map = json_object(model_dir / index, key).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise UserError(f"{key}: {str(model_dir / index)!r} has no weight_map; {REFETCH}")
            shards = [model_dir / name for name in sorted(set(map(str, weight_map.values())))]
            missing = [p.name for p in shards if not p.is_file()]
            if missing:
                are = "is" if len(missing) == 1 else "are"
                raise UserError(f"{key}: {str(model_dir / index)!r} names {_some(missing)}, which {are} "
                                f"not in {str(model_dir)!r}; {REFETCH}")
            return shards
    raise UserError(f"{key}: {str(model_dir)!r} holds no weights (model.safetensors, "
                    f"model.safetensors.index.json and its shards, or pytorch_model.bin); {REFETCH}")


def fingerprint(files: list[Path], sample: int = 1 << 20) -> str:
    """What identifies a set of weight files without reading them whole (a base of many GB): each
    file's name and size, and a MiB from its start, middle and end (a safetensors header names and
    shapes the tensors; the samples are tensor values, which any other checkpoint of the same
    architecture has other)."""
    import hashlib

    h = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            for at in sorted({0, max(0, size // 2 - sample // 2), max(0, size - sample)}):
                f.seek(at)
                h.update(f.read(sample))
    return h.hexdigest()[:16]


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


def check_weights(model_dir: Path) -> None:
    """model.path's weights: the files from_pretrained reads are all there, each opens (safetensors
    checks its header against the file's size) and holds no NaN or inf (training on them would fail
    later with a misleading loss). Read once, tensor by tensor, before the model is built."""
    bad = [name for path in weight_files(model_dir) for name in nonfinite_tensors(_named_tensors(path))]
    if bad:
        raise UserError(f"model.path {str(model_dir)!r}: {_tensors(len(bad))} hold NaN or inf values "
                        f"({_some(bad)}); the weights are damaged: {REFETCH}")

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

