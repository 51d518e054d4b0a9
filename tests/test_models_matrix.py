"""docs/models.md's model-type matrix against the code: bench/models.py's rows (every causal-LM model type of
the pinned transformers: does it build from its config alone; the tiled loss, the fused loss and the tiled MLP
against its own forward; for the most used families the run columns too: 2 steps, export, resume, LoRA)
regenerated here and compared cell by cell with the table. A model type whose verdict changed (a transformers
upgrade, a change to the probe, a speed-up or the run machinery) fails until the table is regenerated:
`python bench/models.py --runs --write`. Compiled layers (`--compile`) and the other types' run columns are the
full matrix's, not regenerated here."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from conftest import ROOT

DOC = ROOT / "docs" / "models.md"
RUN_COLUMNS = ("trains", "export", "resume", "LoRA")
# the most used families (issue 59's list), and a type for each fault the run columns found (2026-11-29): a
# parameter without gradient left out of every checkpoint (afmoe), a multimodal config's text model (gemma3), a
# router returning its experts first (granitemoe), a training forward refused with the KV cache on (jamba), LoRA's
# all-linear on a Mamba hybrid and on a router built on nn.Linear (falcon_h1, phimoe; falcon's own nn.Linear is
# adapted), an export whose config AutoModelForCausalLM did not map (mllama), a backward that is not deterministic
# (ernie4_5_moe: ≈); and (2026-11-30) an nn.Linear that is not x W^T + b kept from all-linear (llama4_text's
# router), a router counting zero-computation experts (longcat_flash), a model without a position limit (xlnet)
RUN_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "mistral", "mixtral", "phi3", "olmo2",
                "deepseek_v3", "gpt_oss", "granite", "smollm3", "afmoe", "gemma3", "granitemoe", "jamba", "falcon_h1",
                "phimoe", "falcon", "mllama", "ernie4_5_moe", "llama4_text", "longcat_flash", "xlnet")


def bench():
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("models_bench", ROOT / "bench" / "models.py")
    module = sys.modules["models_bench"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documented() -> dict[str, dict[str, str]]:
    """The table's rows: model type -> {column: cell} (builds, the speed-ups, the run columns)."""
    text = DOC.read_text()
    table = text[text.index("<!-- models.py: begin -->"):text.index("<!-- models.py: end -->")].splitlines()
    head = next(line for line in table if line.startswith("| model type |"))
    columns = [c.strip() for c in head.strip("|").split("|")][1:]
    rows = {}
    for line in table:
        m = re.match(r"\| `([^`]+)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = dict(zip(columns, (c.strip() for c in m.group(2).split(" | "))))
    return rows


def verdict(cell: str, column: str = "") -> str:
    """What a cell says, without the numbers that vary from machine to machine (a refusal's differences, an
    error's text, a run's losses): ✓, ✓ with its head factor, full logits and why, refused, cannot build."""
    if cell.startswith(("✓", "≈")) and column in RUN_COLUMNS:
        return "✓"  # ≈: the model's own backward is not deterministic, so a resume is bitwise or not by chance
    if cell.startswith(("✓", "full logits")):
        return cell
    return cell.split(":")[0]  # refused, own forward fails at probe size, cannot build, not at probe size, fails


def test_every_causal_lm_model_type_is_in_the_table_once():
    m = bench()
    rows = documented()
    assert sorted(rows) == m.model_types() and m.RUN_COLUMNS == RUN_COLUMNS
    assert all(cells["builds"] == "✓" or cells["builds"].startswith(("cannot build from its config alone: ",
                                                                      "not at probe size")) for cells in rows.values())
    assert not any("runs, wrong" in c for cells in rows.values() for c in cells.values())
    # every type that builds and runs its own forward has the run columns filled: a verdict, never blank
    for model_type, cells in rows.items():
        if cells["builds"] == "✓" and not cells["tiled loss"].startswith("own forward fails"):
            assert all(cells[c].startswith(("✓", "≈", "refused", "fails")) for c in RUN_COLUMNS), (model_type, cells)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_table_is_what_the_code_gives_today(tmp_path):
    """Every model type's row built again (each type tiny, its speed-ups run: 70 s on this CPU alone), and the
    run columns (2 steps, export, resume, LoRA: bench/model_runs.py, through ds_train's own run machinery in
    this process) for the most used families and afmoe (a parameter without gradient, once missing from
    every export): ~40 s more. Compared with docs/models.md: the same verdict in every cell."""
    import contextlib

    m = bench()
    rows = documented()
    disagree = []
    from model_runs import corpus

    with contextlib.redirect_stdout(sys.stderr):
        corpus(tmp_path)
    for model_type in m.model_types():
        got = m.row(model_type, m.SPEEDUPS, tmp_path if model_type in RUN_FAMILIES else None)
        columns = ["builds", *m.SPEEDUPS, *(RUN_COLUMNS if model_type in RUN_FAMILIES else ())]
        cells = {"builds": got["build"], **got["cells"]}
        if [verdict(cells.get(c, ""), c) for c in columns] != [verdict(rows[model_type][c], c) for c in columns]:
            disagree.append(f"{model_type}: table {rows[model_type]}, code {cells}")
    assert not disagree, ("docs/models.md disagrees with the code (python bench/models.py --runs --write):\n"
                          + "\n".join(disagree))
    assert all(rows[t][c].startswith(("✓", "≈")) for t in RUN_FAMILIES for c in RUN_COLUMNS), \
        {t: rows[t] for t in RUN_FAMILIES}
