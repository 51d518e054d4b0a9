"""docs/models.md's model-type matrix against the code: bench/models.py's rows (every causal-LM model type of
the pinned transformers: does it build from its config alone; the tiled loss, the fused loss and the tiled MLP
against its own forward; for the most used families the run columns too: 2 steps, export, resume, LoRA)
regenerated here and compared cell by cell with the table. A model type whose verdict changed (a transformers
upgrade, a change to the probe, a speed-up or the run machinery) fails until the table is regenerated:
`python bench/models.py --runs --write`. Compiled layers (`--compile`) and the other types' run columns are the
full matrix's, regenerated here on a sample: the whole command (`--all`) for one type, one checkpoint and one
family's launch, into a copy of the page. The named checkpoints' table (bench/configs/) is compared the same way,
and the memory plan's tiled MLP layers are checked against what the tiled MLP tiles on each checkpoint at full
size (on the meta device)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys

import pytest

from conftest import ROOT, run_cmd

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



@pytest.fixture(autouse=True)
def own_environment():
    """The in-process runs (bench/model_runs.py) set RANK, MASTER_PORT, ... for the gloo group this process keeps:
    the worker's environment put back after each test, or the launches of the tests after it (in this process and
    in the commands it starts) inherit a port this process holds (EADDRINUSE)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)

def bench():
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("models_bench", ROOT / "bench" / "models.py")
    module = sys.modules["models_bench"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documented(doc=DOC, marker: str = "models.py", first: str = "model type") -> dict[str, dict[str, str]]:
    """A table's rows: its first column -> {column: cell} (the types' table: builds, the speed-ups, the run
    columns; marker "models.py checkpoints": the checkpoints'; "model_families.py": the families')."""
    table = section(doc, marker).splitlines()
    head = next(line for line in table if line.startswith(f"| {first} |"))
    columns = [c.strip() for c in head.strip("|").split("|")][1:]
    rows = {}
    for line in table:
        m = re.match(r"\| `([^`]+)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = dict(zip(columns, (c.strip() for c in m.group(2).split(" | "))))
    return rows


def section(doc, marker: str) -> str:
    """What `doc` holds between <!-- {marker}: begin --> and its end marker."""
    text = doc.read_text()
    return text[text.index(f"<!-- {marker}: begin -->"):text.index(f"<!-- {marker}: end -->")]


DATED = re.compile(r"^(Run again: .*)?`python bench/(models|model_families)\.py[^`]*`, \d{4}-\d\d-\d\d, commit "
                   r"[0-9a-f]{7,}\+?, transformers ", re.M)


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
    # "not applicable" apart from ✓: an MoE block is never tiled, so its tiled MLP is n/a, never ✓ (issue 73: the
    # table said ✓ for every MoE type); a ✓ of some layers says how many
    mlp = {t: cells.get("tiled MLP", "") for t, cells in rows.items() if cells["builds"] == "✓"}
    assert all(re.fullmatch(r"✓( \d+ of \d+ layers)?|n/a: nothing it tiles.*|refused: .*|own forward fails.*", c)
               for c in mlp.values()), mlp
    assert all(mlp[t].startswith("n/a") for t in ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "jamba", "granitemoe")), \
        {t: mlp[t] for t in ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "jamba", "granitemoe")}
    assert mlp["deepseek_v3"] == "✓ 1 of 2 layers" and mlp["llama"] == "✓"
    # the checkpoints' table: every config of bench/configs once; each table dated with its commit
    assert sorted(documented(DOC, "models.py checkpoints", "checkpoint")) == m.checkpoint_names()
    for marker in ("models.py", "models.py checkpoints", "model_families.py"):
        assert DATED.search(section(DOC, marker)), f"docs/models.md's {marker} table names no commit"
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


def test_the_plan_tiles_only_the_mlps_the_run_tiles():
    """The memory plan counts the tiled MLP's saving for the decoder layers whose MLP the run tiles, on each named
    checkpoint at full size (the meta device): tiled_mlps on the full model, layer by layer. Where it tiles none
    (every MoE type, Jamba's, Bamba's and LFM2's feed_forward; GPT-OSS's block, whose tiles the probe refuses) the
    plan with train.mlp_tile_positions is the plan without; where some (DeepSeek-V3's 3 dense layers of 61),
    between. The checkpoints' table says the same."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_train.model.tiled_mlp import tiled_mlps
    from ds_train.plan.memory import activation_bytes, model_shape

    m = bench()
    table = documented(DOC, "models.py checkpoints", "checkpoint")
    tiled = {}
    for name in m.checkpoint_names():
        config = AutoConfig.for_model(**json.loads((ROOT / "bench" / "configs" / name / "config.json").read_text()))
        shape = model_shape(config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        classes = tiled_mlps(model, 8192, 16384)[0]
        layers = model.get_decoder().layers
        kept = not table[name]["tiled MLP"].startswith("refused")  # the probe turns it off (GPT-OSS's MoE block)
        tiled[name] = kept * sum(any("forward" in vars(x) and type(x).__name__ in classes for x in layer.modules())
                                 for layer in layers)
        assert shape.tiled_mlp_layers == tiled[name] and shape.n_layers == len(layers), name
        whole, tiles = (activation_bytes(shape, 1, 16384, "bf16", False, mlp_tile_positions=t).peak for t in (0, 8192))
        assert (tiles < whole) if tiled[name] else (tiles == whole), (name, whole, tiles)
        assert table[name]["MLPs the plan tiles (full size)"] == f"{tiled[name]} of {len(layers)} layers", name
    assert tiled["mixtral-8x7b"] == tiled["qwen3-30b-a3b"] == tiled["jamba-v0.1"] == 0
    assert tiled["deepseek-v3"] == 3 and tiled["llama-3.1-8b"] == 32 and tiled["gemma-3-4b"] == 34
    assert tiled["gpt-oss-20b"] == 0
    # a mixture of experts' block whose class's name ends in MLP, its experts nn.Linear (GPT-OSS's hold theirs as
    # parameters): not counted, as the probe refuses its tiles; a dense MLP beside it is
    from ds_train.plan.memory import tiled_mlp_layers

    class MoeMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    class DenseMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(8, 16)

    decoder = torch.nn.ModuleList(torch.nn.ModuleDict({"mlp": kind()}) for kind in (MoeMLP, DenseMLP, DenseMLP))
    assert tiled_mlp_layers(decoder, 8, 3) == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_checkpoints_table_is_what_the_code_gives_today():
    """Every named checkpoint's row built again (its own config at the run's shrink, the probe's comparisons:
    ~40 s on this CPU) and compared with docs/models.md's checkpoints' table, verdict by verdict; the compiled
    column is the full matrix's (the sample below regenerates one)."""
    m = bench()
    rows = documented(DOC, "models.py checkpoints", "checkpoint")
    disagree = []
    for name in m.checkpoint_names():
        got = m.checkpoint_row(name, m.SPEEDUPS)
        cells = {"model type": f"`{got['type']}`", "builds": got["build"], **got["cells"],
                 "MLPs the plan tiles (full size)": got["planned"]}
        if any(verdict(cells[c], c) != verdict(rows[name][c], c) for c in cells):
            disagree.append(f"{name}: table {rows[name]}, code {cells}")
    assert not disagree, ("docs/models.md's checkpoints disagree with the code (python bench/models.py "
                          "--checkpoints --compile --write):\n" + "\n".join(disagree))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_whole_matrix_command_on_a_sample(tmp_path):
    """`python bench/models.py --all` (the one command that regenerates every table of docs/models.md, compiled
    layers and the families' launches among them) on its sample, into a copy of the page: granite's row with its
    run and compiled columns, Llama-3.1-8B's checkpoint row with its compiled column, Llama's ZeRO-3 launch (2
    processes, against the one-process reference). Each rewritten row is dated with this commit, agrees with the
    page's row verdict by verdict, and nothing else of the page changed."""
    copy = tmp_path / "models.md"
    shutil.copy(DOC, copy)
    said = run_cmd([sys.executable, "bench/models.py", "--all", "--sample", "--doc", str(copy)], timeout=540)
    assert said.returncode == 0, said.out[-3000:]
    sha = run_cmd(["git", "rev-parse", "--short", "HEAD"], timeout=30).out.strip()
    for marker, first, key, command in (
            ("models.py", "model type", "granite", f"--all --sample --doc {copy}"),
            ("models.py checkpoints", "checkpoint", "llama-3.1-8b", f"--all --sample --doc {copy}"),
            ("model_families.py", "family (model type)", "llama", "--families llama --columns ZeRO-3")):
        again = section(copy, marker).strip().splitlines()[-1]
        assert again.startswith(f"Run again: {key}") and command in again, again
        assert re.search(rf", commit {sha}\+?, ", again) and DATED.search(again), again
        new, old = documented(copy, marker, first)[key], documented(DOC, marker, first)[key]
        same = (lambda a, b, c: a[:1] == b[:1]) if marker == "model_families.py" else \
            (lambda a, b, c: verdict(a, c) == verdict(b, c))
        assert all(same(new[c], old[c], c) for c in old), (marker, new, old)
        assert {k: v for k, v in documented(copy, marker, first).items() if k != key} == \
            {k: v for k, v in documented(DOC, marker, first).items() if k != key}, marker
    assert "compiled layers" in documented(copy)["granite"] and "compiled layers" in documented(
        copy, "models.py checkpoints", "checkpoint")["llama-3.1-8b"]
    assert documented(copy, "model_families.py", "family (model type)")["llama"]["ZeRO-3"].startswith("✓ ")

    def outside(doc):  # the page but for the three tables
        text = doc.read_text()
        for marker in ("models.py", "models.py checkpoints", "model_families.py"):
            text = text.replace(section(doc, marker), "")
        return text

    assert outside(copy) == outside(DOC)


def test_the_commands_refuse_bad_input_in_one_line(monkeypatch):
    """A checkpoint not in bench/configs, a sample without a copy to write into (it would write the page itself),
    a column that is not one: each one line naming the value and what to give, before anything runs."""
    m = bench()
    for argv, said in ((["--checkpoints", "llama-9"], "--checkpoints llama-9: not in bench/configs (it has "),
                       (["--all", "--sample"], "give --all and --doc COPY"),
                       (["--columns", "tiled MLP,trains"], "--columns tiled MLP,trains: give speed-up columns")):
        monkeypatch.setattr(sys, "argv", ["bench/models.py", *argv])
        with pytest.raises(SystemExit) as e:
            m.main()
        assert said in str(e.value) and "\n" not in str(e.value), str(e.value)
