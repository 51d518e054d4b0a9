"""The import contract (pyproject.toml, [tool.importlinter]): it holds, it covers every module, and
a wrong import in a scratch copy of the package breaks it."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest

from conftest import BIN, ROOT, run_cmd

LINT = str(BIN / "lint-imports")  # --no-cache: nothing written beside the code


def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def names(layers: list[str]) -> set[str]:
    return {m.strip() for layer in layers for m in layer.replace("|", ":").split(":")}


def layered_modules() -> set[str]:
    return names(next(c for c in contracts() if c["id"] == "layers")["layers"])


def test_each_package_with_its_own_order_names_every_module_it_holds():
    """A package's own contract (its entry points above its parts) places each of its modules: a new
    module of ds_train/checkpoint/ must say where it sits in the room."""
    rooms = [c for c in contracts() if c.get("containers")]
    assert {c["id"] for c in rooms} == {"checkpoint", "observe", "plan", "train", "ript", "launch"}
    for c in rooms:
        package = ROOT / Path(*c["containers"][0].split("."))
        held = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
        assert names(c["layers"]) == held, c["id"]


def test_the_contract_holds():
    res = run_cmd([LINT, "--no-cache"], timeout=120)
    assert res.returncode == 0, res.out
    assert f"{len(contracts())} kept, 0 broken" in res.out


def test_every_module_has_a_layer():
    """A new module must be placed: one outside every layer would escape the contract (a module of a
    package whose name is layered, ds_train.data.prepare, is in its package's layer)."""
    modules = {".".join(p.with_suffix("").relative_to(ROOT).parts) for p in (ROOT / "ds_train").rglob("*.py")
               if p.name != "__init__.py"}
    layered = layered_modules()

    def placed(module: str) -> bool:
        parts = module.split(".")
        return any(".".join(parts[:i]) in layered for i in range(2, len(parts) + 1))

    assert {m for m in modules if not placed(m)} == set()
    packages = {m.rsplit(".", 1)[0] for m in modules}
    assert layered - modules - packages == set()  # no stale names either


@pytest.fixture
def scratch(tmp_path) -> Path:
    """A copy of the package and the contract, where a wrong import can be planted."""
    shutil.copytree(ROOT / "ds_train", tmp_path / "ds_train", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "import_contracts.py", tmp_path / "tests")
    return tmp_path


def plant(path: Path, after: str, line: str) -> None:
    text = path.read_text()
    assert after in text
    path.write_text(text.replace(after, f"{after}\n{line}", 1))


def lint(where: Path) -> str:
    """lint-imports in `where` (its working directory comes first on sys.path: it reads the
    scratch copy); its exit code must be 1, and its report comes back with the lines unwrapped."""
    res = run_cmd([LINT, "--no-cache"], cwd=where, timeout=120)
    assert res.returncode == 1, res.out
    return " ".join(res.out.split())


def test_an_upward_import_breaks_the_layers_and_makes_a_cycle(scratch):
    plant(scratch / "ds_train" / "config" / "__init__.py", "from typing import Literal", "from ds_train.run import Run")
    out = lint(scratch)
    assert "ds_train.config is not allowed to import ds_train.run" in out
    assert "No import cycle in ds_train BROKEN" in out
    assert "Only ds_train.dist imports torch.distributed / deepspeed.comm KEPT" in out


def test_siblings_of_one_layer_may_not_import_each_other_and_a_part_not_its_room_s_entry_point(scratch):
    plant(scratch / "ds_train" / "dryrun.py", "from ds_train.start import build_run",
          "from ds_train.parity import layouts")
    plant(scratch / "ds_train" / "checkpoint" / "commit.py", "from ds_train.fs import fsync_dir, write_atomic",
          "from ds_train.checkpoint.checkpointer import Checkpointer")
    out = lint(scratch)
    assert "ds_train.dryrun is not allowed to import ds_train.parity" in out
    assert "ds_train.checkpoint: its entry points above its parts BROKEN" in out
    assert "ds_train.checkpoint.commit is not allowed to import ds_train.checkpoint.checkpointer" in out


@pytest.mark.parametrize("line", ["from torch import distributed", "import deepspeed.comm as comm",
                                  "from torch.distributed import all_reduce"])
def test_only_dist_touches_torch_distributed(scratch, line):
    plant(scratch / "ds_train" / "data" / "datasets.py", "import numpy as np", line)
    out = lint(scratch)
    assert "Only ds_train.dist imports torch.distributed / deepspeed.comm BROKEN" in out
    line_no = (ROOT / "ds_train" / "data" / "datasets.py").read_text().splitlines().index("import numpy as np") + 2
    assert f"ds_train.data.datasets:{line_no} imports" in out and "only ds_train.dist may" in out
