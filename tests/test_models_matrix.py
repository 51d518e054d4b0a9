"""docs/models.md's model-type matrix against the code: bench/models.py's rows (every causal-LM model type of
the pinned transformers: does it build from its config alone; the tiled loss, the fused loss and the tiled MLP
against its own forward) regenerated here and compared cell by cell with the table. A model type whose verdict
changed (a transformers upgrade, a change to the probe or a speed-up) fails until the table is regenerated:
`python bench/models.py --write`. Compiled layers (`--compile`) are the full matrix's, not regenerated here."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from conftest import ROOT

DOC = ROOT / "docs" / "models.md"


def bench():
    spec = importlib.util.spec_from_file_location("models_bench", ROOT / "bench" / "models.py")
    module = sys.modules["models_bench"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documented() -> dict[str, list[str]]:
    """The table's rows: model type -> [builds, tiled loss, fused loss, tiled MLP]."""
    text = DOC.read_text()
    rows = {}
    for line in text[text.index("<!-- models.py: begin -->"):text.index("<!-- models.py: end -->")].splitlines():
        m = re.match(r"\| `([^`]+)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split(" | ")][:4]
    return rows


def verdict(cell: str) -> str:
    """What a cell says, without the numbers that vary from machine to machine (a refusal's differences, an
    error's text): ✓, ✓ with its head factor, full logits and why, refused, cannot build."""
    if cell.startswith(("✓", "full logits")):
        return cell
    return cell.split(":")[0]  # refused, own forward fails at probe size, cannot build, not at probe size


def test_every_causal_lm_model_type_is_in_the_table_once():
    m = bench()
    rows = documented()
    assert sorted(rows) == m.model_types()
    assert all(cells[0] == "✓" or cells[0].startswith(("cannot build from its config alone: ", "not at probe size"))
               for cells in rows.values())
    assert not any("runs, wrong" in c for cells in rows.values() for c in cells)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_table_is_what_the_code_gives_today():
    """Every model type's row built again (each type tiny, its speed-ups run: 70 s on this CPU alone) and
    compared with docs/models.md: the same verdict in every cell."""
    m = bench()
    rows = documented()
    disagree = []
    for model_type in m.model_types():
        got = m.row(model_type, m.SPEEDUPS)
        cells = [got["build"], *(got["cells"].get(s, "") for s in m.SPEEDUPS)]
        if [verdict(c) for c in cells] != [verdict(c) for c in rows[model_type]]:
            disagree.append(f"{model_type}: table {rows[model_type]}, code {cells}")
    assert not disagree, ("docs/models.md disagrees with the code (python bench/models.py --write):\n"
                          + "\n".join(disagree))
