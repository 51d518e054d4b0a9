"""An import-linter contract type for submodules of external packages.

import-linter's own `forbidden` contract takes external packages at their root only (`torch`, not
`torch.distributed`): its graph squashes every external package into one node. This contract reads
the import statements behind each such edge (grimp keeps their line numbers) and names every module
of the root package outside `allowed_importers` that imports one of `forbidden_modules` or anything below it:

    [[tool.importlinter.contracts]]
    type = "external_submodules"
    forbidden_modules = ["torch.distributed", "deepspeed.comm"]
    allowed_importers = ["ds_train.dist"]

Registered in pyproject.toml under `contract_types`; lint-imports runs from the repository root,
so `tests.import_contracts` is importable.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import lru_cache

from importlinter import Contract, ContractCheck, fields, output


@lru_cache(maxsize=None)
def _statements(module: str) -> dict[int, list[str]]:
    """Line number -> the dotted names an import statement there brings in."""
    spec = importlib.util.find_spec(module)
    tree = ast.parse(open(spec.origin).read())
    out: dict[int, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.setdefault(node.lineno, []).extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if a.name != "*"]
            out.setdefault(node.lineno, []).extend(names)
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


class ExternalSubmodulesContract(Contract):
    type_name = "external_submodules"

    forbidden_modules = fields.ListField(subfield=fields.StringField())
    allowed_importers = fields.ListField(subfield=fields.StringField())

    def check(self, graph, verbose: bool) -> ContractCheck:
        forbidden = list(self.forbidden_modules)
        packages = sorted({name.split(".")[0] for name in forbidden})
        roots_of_ours = self.session_options["root_packages"]
        importers = sorted(set().union(*({r} | graph.find_descendants(r) for r in roots_of_ours)))
        broken = []
        for importer in importers:
            if any(_under(importer, allowed) for allowed in self.allowed_importers):
                continue
            for package in packages:
                for detail in graph.get_import_details(importer=importer, imported=package):
                    line = detail["line_number"]
                    for name in _statements(importer).get(line, []):
                        if any(_under(name, f) for f in forbidden):
                            broken.append({"importer": importer, "line": line, "imported": name,
                                           "contents": detail["line_contents"]})
        return ContractCheck(kept=not broken, metadata={"broken": broken})

    def render_broken_contract(self, check: ContractCheck) -> None:
        allowed = ", ".join(self.allowed_importers)
        for b in check.metadata["broken"]:
            output.print_error(f"{b['importer']}:{b['line']} imports {b['imported']} ({b['contents']}); "
                               f"only {allowed} may")
            output.new_line()
