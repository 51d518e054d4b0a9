"""The model-type matrix: every causal-LM model type of the pinned transformers that builds from its config
alone, tiny, with every multiplier, scale and cap moved off its identity value (a default of 1.0 hides exactly
the bugs this looks for); per type, each speed-up against the model's own forward, the start-up probe's
comparison (ds_train/train/probe.py: `differences`), in fp32 on this CPU.

    python bench/models.py                          # the table on stdout
    python bench/models.py --write                  # ... and into docs/models.md (between its markers)
    python bench/models.py --compile                # compiled layers too (inductor compiles each type's layers)
    python bench/models.py --types llama,granite    # some model types only
    python bench/models.py --runs                   # and the one-process run columns (bench/model_runs.py)
    python bench/models.py --checkpoints --write    # the named checkpoints' table (bench/configs/*/config.json)
    python bench/models.py --all --write            # the whole matrix: --runs --compile, the checkpoints with
                                                    # --compile, then the families' two-process table
                                                    # (bench/model_families.py); each table dated with its commit
    python bench/models.py --all --sample --doc D   # a sample of each of those parts into D (the suite's check)

A cell is what a run of that model type gets: ✓ (the speed-up matches the model's own forward; ×c: the tiled
loss with the head factor c the probe measured), or the probe's verdict in short: "full logits" (the tiled
loss cannot follow the model after its head: on by default it is turned off, asked for it is refused), "refused"
(it differs: the probe refuses it, or turns a default off), "n/a" (nothing of the model is replaced: the tiled MLP
found no MLP it tiles, as in every MoE block; "✓ k of n layers" where it tiles some). No cell is "runs, wrong":
whatever differs is refused. A model type that does not build from its config alone says why. The probe model's vocabulary is cut
to VOCAB tokens here (the speed-ups do not depend on it; a run's probe keeps the model's).
The named checkpoints (--checkpoints): the public config.json of real checkpoints, shipped in bench/configs/ (its
README says where each comes from), through the same probe at the run's shrink (their own values: nothing moved
off identity), with the layers whose MLP the memory plan counts as tiled at full size (ds_train/plan/memory.py's
`tiled_mlp_layers`, on the meta device).
tests/test_models_matrix.py runs this (without --compile) and fails where it and docs/models.md disagree.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import tempfile
import sys
import time
import warnings
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "bench"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench import cli  # noqa: E402

VOCAB = 1024
MAX_PARAMS = 50_000_000  # a probe-size model past this keeps a width the shrink does not know: said, not built
TYPE_SECONDS = 60  # one model type's time limit (three times it with --compile: inductor's first compile of a type)
SPEEDUPS = ("tiled loss", "fused loss", "tiled MLP")
RUN_COLUMNS = ("trains", "export", "resume", "LoRA")  # bench/model_runs.py's (--runs)
OFF_IDENTITY = re.compile(r"multiplier|scale|scaling")
CAP = re.compile(r"softcap|soft_cap")
BEGIN, END = "<!-- models.py: begin -->", "<!-- models.py: end -->"
CHECKPOINTS_BEGIN, CHECKPOINTS_END = "<!-- models.py checkpoints: begin -->", "<!-- models.py checkpoints: end -->"
DOC = ROOT / "docs" / "models.md"
CHECKPOINTS = ROOT / "bench" / "configs"  # <name>/config.json: a real checkpoint's public config
SAMPLE = {"types": "granite", "checkpoints": "llama-3.1-8b", "families": "llama", "columns": "ZeRO-3"}  # --sample
NOT_APPLICABLE = "n/a"
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "CROSS_RANK", "CROSS_SIZE", "GROUP_RANK")


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def off_identity(config: dict) -> tuple[dict, list[str]]:
    """Every float multiplier, scale or scaling at 1.0 set to 0.5, every soft cap that is off set to 30, an
    unpadded vocabulary that is off (None) set 8 below the vocabulary (the logits cut after the head)."""
    moved, said = dict(config), []
    for key, value in config.items():
        if key.endswith("_config") and isinstance(value, dict):  # a multimodal model's text model, ...
            moved[key], inner = off_identity(value)
            said += [f"{key}.{s}" for s in inner]
            continue
        if value is None and "unpadded_vocab" in key and isinstance(config.get("vocab_size"), int):
            moved[key] = config["vocab_size"] - 8
            said.append(f"{key} {moved[key]}")
            continue
        if isinstance(value, float) and value == 1.0 and OFF_IDENTITY.search(key):
            moved[key] = 0.5
            said.append(f"{key} 0.5")
        elif value is None and CAP.search(key):
            moved[key] = 30.0
            said.append(f"{key} 30")
    return moved, said


def probe_config(model_type: str, head_dim: int = 16, heads_multiple: int = 1, source: dict | None = None):
    """The model type's default config, tiny (model/shrunk.py; heads a multiple of `heads_multiple`), off
    identity, its vocabulary cut to VOCAB. `source`: a checkpoint's config.json instead of the default, shrunk
    as a run's probe shrinks it and kept at its own values (nothing moved off identity)."""
    from transformers import AutoConfig

    from ds_train.model.shrunk import shrink_model

    full = AutoConfig.for_model(**source) if source else AutoConfig.for_model(model_type)
    small, _ = shrink_model(full, heads_multiple, head_dim)
    small.pop("model_type")
    cut_vocabulary(small)
    for key in ("id2label", "label2id"):  # a classifier's labels, at their defaults (and int keys YAML has not)
        small.pop(key, None)
    small, moved = (small, []) if source else off_identity(small)
    return AutoConfig.for_model(model_type, **small), moved, {"model_type": model_type, **small}


def cut_vocabulary(config: dict) -> None:
    """The vocabulary cut to VOCAB tokens, in the config and in its sub-models' (a multimodal model's text model)."""
    for part in [config, *(v for k, v in config.items() if k.endswith("_config") and isinstance(v, dict))]:
        if not isinstance(part.get("vocab_size"), int):
            continue
        for key in [k for k in part if k.startswith("vocab_size") and isinstance(part[k], int)]:  # Gemma 3n's too
            part[key] = min(part[key], VOCAB)
        for key in [k for k in part if k.endswith("_token_id")]:  # pad, bos, eos, sep, decoder_start, ...
            if isinstance(part[key], int) and part[key] >= VOCAB:
                part[key] = VOCAB - 1
            elif isinstance(part[key], list):
                part[key] = sorted({min(i, VOCAB - 1) for i in part[key]})


def build(config):
    """The model from `config`, seeded, fp32, on the CPU; its parameter count checked on the meta device first."""
    import torch
    from transformers import AutoModelForCausalLM

    from ds_train.model.build import from_scratch

    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"{n / 1e6:.0f}M parameters at probe size (a width model/shrunk.py does not cut)")
    try:
        model, _ = from_scratch(config, 0, False, attn_implementation="sdpa", dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - a model without sdpa: a run sets model.attn_implementation=eager
        if "attention implementation" not in str(e):
            raise
        model, _ = from_scratch(config, 0, False, attn_implementation="eager", dtype=torch.float32)
    return model.train()


def row(model_type: str, speedups: tuple[str, ...], runs: Path | None = None, source: dict | None = None) -> dict:
    """One model type's cells (see the module); `runs`: the run columns too (bench/model_runs.py), in
    `runs` (the prepared corpus in runs/data; each type's runs in runs/<type>, removed after); `source`: a
    checkpoint's config.json in place of the type's default config (probe_config)."""
    from ds_train.train.probe import _ids, differences

    start = time.monotonic()
    try:
        config, moved, written = probe_config(model_type, source=source)
        built = build(config)
    except Exception as e:  # noqa: BLE001 - its cells say why
        why = "not at probe size (model/shrunk.py)" if source else not_built(model_type)
        return {"type": model_type, "build": f"{why}: {short(e)}", "cells": {}, "moved": [],
                "seconds": round(time.monotonic() - start, 1)}
    try:
        diffs, factor = differences(lambda: build(config), _ids(config, 0), list(speedups), "fp32", "cpu",
                                    lambda: build(probe_config(model_type, head_dim=32, source=source)[0]))
        cells = {name: cell(name, diff, factor) for name, diff in diffs.items()}
        if cells.get("tiled MLP", "").startswith("✓"):  # it matched: but was anything tiled? (the model built
            cells["tiled MLP"] = mlp_cell(built)  # first: the comparisons build their own)
    except Exception as e:  # noqa: BLE001 - the model's own forward fails at probe size: the run's probe would too
        cells = {name: f"own forward fails at probe size: {short(e)}" for name in speedups}
    if runs is not None and not any(c.startswith("own forward fails") for c in cells.values()):
        from model_runs import run_cells

        try:
            cells.update(run_cells(model_type, written, runs / "data", runs / model_type))
        finally:
            shutil.rmtree(runs / model_type, ignore_errors=True)
    return {"type": model_type, "build": "✓", "cells": cells, "moved": moved,
            "seconds": round(time.monotonic() - start, 1)}


def mlp_cell(model) -> str:
    """The tiled MLP's cell where it matched the model's own forward: ✓ where it tiles every decoder layer's MLP of
    the probe model, "✓ k of n layers" where some, n/a where none (an MoE block, an MLP it does not take: its probe
    compared the model with itself). What it tiles at full size is the plan's (`tiled_mlp_layers`, the checkpoints'
    table)."""
    from ds_train.model.tiled_mlp import tiled_mlps
    from ds_train.train.probe import LENGTH, MLP_TILE

    tiled, layers = tiled_layers(model, tiled_mlps(model, MLP_TILE, LENGTH)[0])
    if not tiled:
        blocks = sorted({type(m).__name__ for n, m in model.named_modules()
                         if n.rsplit(".", 1)[-1] in ("mlp", "feed_forward", "block_sparse_moe", "ffn", "moe")})
        return f"{NOT_APPLICABLE}: nothing it tiles" + (f" ({', '.join(blocks[:3])})" if blocks else "")
    return "✓" if not layers or tiled >= layers else f"✓ {tiled} of {layers} layers"


def tiled_layers(model, classes: list[str]) -> tuple[int, int]:
    """(the decoder layers with a tiled MLP, the decoder layers): modules whose forward tiled_mlps replaced (an
    instance's own), counted once per decoder layer (the text model's `layers`; a vision tower's MLPs are not
    among them)."""
    try:
        decoder = model.get_decoder()
    except Exception:  # noqa: BLE001 - a model without one
        decoder = None
    layers = getattr(decoder, "layers", None)
    if layers is None:  # no decoder layers to count by: every tiled module, of the config's layers
        return (sum("forward" in vars(m) for m in model.modules() if type(m).__name__ in classes),
                getattr(model.config.get_text_config(), "num_hidden_layers", 0) or 0)
    return (sum(any("forward" in vars(m) and type(m).__name__ in classes for m in layer.modules()) for layer in layers),
            len(layers))


def not_built(model_type: str) -> str:
    """Why a probe-size model was not built: its default config does not build either (on the meta device), or
    our shrink of it (model/shrunk.py) does not."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))
    except Exception:  # noqa: BLE001
        return "cannot build from its config alone"
    return "not at probe size (model/shrunk.py)"


def cell(name: str, diff: str, factor: float | None) -> str:
    if not diff:
        return f"✓ ×{factor:g}" if name in ("tiled loss", "fused loss") and factor not in (None, 1) else "✓"
    if "not a constant times its head's output" in diff or "is not its head's output" in diff or "after its head" \
            in diff or "at one width" in diff:
        return "full logits: " + ("a cut of the vocabulary" if "shape" in diff else
                                  diff.split("depend on ")[1].replace(" after its head", " after the head")
                                  if "depend on" in diff else "an op after the head")
    return "refused: " + diff.split(";")[0]


def short(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:120]}"


def table(rows: list[dict], speedups: tuple[str, ...]) -> str:
    head = ["model type", "builds", *speedups, "moved off identity"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["cells"].get(s, "") for s in speedups]
        lines.append("| " + " | ".join([f"`{r['type']}`", r["build"], *cells, ", ".join(r["moved"])]).replace(
            "\n", " ") + " |")
    return "\n".join(lines)


def counts(rows: list[dict]) -> str:
    built = [r for r in rows if r["build"] == "✓"]
    runs = [r for r in built if not any(c.startswith("own forward fails") for c in r["cells"].values())]
    exact = [r for r in runs if all(c.startswith(("✓", NOT_APPLICABLE)) for k, c in r["cells"].items()
                                    if k not in RUN_COLUMNS)]
    cannot = [r for r in rows if r["build"].startswith("cannot build")]
    idle = sum(r["cells"].get("tiled MLP", "").startswith(NOT_APPLICABLE) for r in runs)
    some = sum(r["cells"].get("tiled MLP", "").startswith("✓ ") for r in runs)
    return (f"{len(rows)} causal-LM model types: {len(cannot)} cannot build from their config alone, "
            f"{len(rows) - len(built) - len(cannot)} not at probe size (the shrink does not fit them yet), "
            f"{len(built) - len(runs)} whose own forward fails at probe size; of the {len(runs)} probed, {len(exact)} "
            f"keep every speed-up checked, {len(runs) - len(exact)} have one turned off by default or refused where "
            f"asked (never run wrong); the tiled MLP tiles nothing of {idle} (n/a) and some of the layers of {some}") \
        + "".join(f"; {column}: {run_counts(rows, column)}" for column in RUN_COLUMNS
                  if any(column in r["cells"] for r in rows))


def run_counts(rows: list[dict], column: str) -> str:
    cells = [r["cells"][column] for r in rows if column in r["cells"]]
    said = [f"{sum(c.startswith(mark) for c in cells)} {name}" for mark, name in
            (("✓", "✓"), ("≈", "≈"), ("refused", "refused"), ("fails", "fail"))]
    return ", ".join(s for s in said if not s.startswith("0 ") or s.endswith(("✓", "fail")))


def main() -> int:
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="", help="comma-separated model types (default: every causal-LM type)")
    ap.add_argument("--compile", action="store_true", help="compiled layers too (inductor: slow on a CPU)")
    ap.add_argument("--runs", action="store_true", help="the one-process run columns too: 2 steps, export, "
                    "resume, LoRA (bench/model_runs.py)")
    ap.add_argument("--columns", default="", help="comma-separated speed-up columns to run again (of "
                    f"{', '.join(SPEEDUPS)}, compiled layers); with --write the others' cells are kept")
    ap.add_argument("--checkpoints", nargs="?", const="all", default="", help="the named checkpoints' table "
                    f"instead: these of {CHECKPOINTS.relative_to(ROOT)} (comma-separated; default: every one)")
    ap.add_argument("--all", action="store_true", help="the whole matrix: --runs --compile, the checkpoints with "
                    "--compile, then the most used families on two processes (bench/model_families.py, with "
                    "--write when given); every table dated with its commit")
    ap.add_argument("--sample", action="store_true", help=f"with --all: a sample of each part (types "
                    f"{SAMPLE['types']}, checkpoint {SAMPLE['checkpoints']}, family {SAMPLE['families']}'s "
                    f"{SAMPLE['columns']} column), their rows merged into --doc: the suite's check of the command")
    ap.add_argument("--write", action="store_true", help=f"write the table into --doc")
    ap.add_argument("--doc", default="", help=f"the page the tables are written into (default: "
                    f"{DOC.relative_to(ROOT)}; --sample needs one: a copy)")
    ap.add_argument("--json", default="", help="also write the rows as JSON here")
    args = ap.parse_args()
    if args.sample and not (args.all and args.doc):
        raise cli.fail("--sample samples --all into a copy of the page: give --all and --doc COPY")
    doc = Path(args.doc or DOC) if Path(args.doc or DOC).is_absolute() else ROOT / args.doc
    if args.write and not doc.is_file():
        raise cli.fail(f"--doc {args.doc}: no such file to write the tables into")
    if args.all:
        args.runs = args.compile = True
        if args.sample:
            args.types = args.types or SAMPLE["types"]
            args.write = True
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    start = time.monotonic()
    if args.checkpoints and not args.all:
        return checkpoints_main(args.checkpoints, args, doc, start)
    every = model_types()
    types = [t for t in args.types.split(",") if t] or every
    unknown = sorted(set(types) - set(every))
    if unknown:
        raise cli.fail(f"--types {','.join(unknown)}: not causal-LM model types of this transformers")
    speedups = SPEEDUPS + (("compiled layers",) if args.compile else ())
    some = tuple(c for c in args.columns.split(",") if c)
    if set(some) - set(SPEEDUPS + ("compiled layers",)) or (some and (args.runs or args.all)):
        raise cli.fail(f"--columns {args.columns}: give speed-up columns ({', '.join(SPEEDUPS)}, compiled layers), "
                       f"without --runs or --all")
    speedups = some or speedups
    runs = Path(tempfile.mkdtemp(prefix="ds_train_models_")) if args.runs else None
    if runs is not None:
        from model_runs import corpus

        with contextlib.redirect_stdout(sys.stderr):
            corpus(runs)
        speedups += RUN_COLUMNS
    rows = []
    with time_limit(TYPE_SECONDS * (3 if "compiled layers" in speedups else 1)) as limit:
        for model_type in types:
            with limit():
                rows.append(row(model_type, tuple(s for s in speedups if s in SPEEDUPS + ("compiled layers",)), runs))
            print(json.dumps(rows[-1], ensure_ascii=False), file=sys.stderr, flush=True)
    seconds = time.monotonic() - start
    if runs is not None:
        shutil.rmtree(runs, ignore_errors=True)
    text = report(rows, speedups, seconds, "python bench/models.py " + shlex.join(sys.argv[1:]))
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, ensure_ascii=False, indent=1))
    if args.write:
        write_between(doc, BEGIN, END, merged(rows, speedups, text, doc, bool(some)) if args.types or some else text)
    if args.all:  # the checkpoints' table, then the two-process columns: their own processes, their own table
        import subprocess

        checkpoints_main(SAMPLE["checkpoints"] if args.sample else args.checkpoints or "all", args, doc,
                         time.monotonic())
        families = [sys.executable, str(ROOT / "bench" / "model_families.py"), "--doc", str(doc),
                    *(["--write"] if args.write else []),
                    *(["--families", SAMPLE["families"], "--columns", SAMPLE["columns"]] if args.sample else [])]
        # without this process's rank variables: its runs (--runs) set RANK, MASTER_PORT, ... for their gloo group,
        # and a launch that inherits them binds that port again (DistNetworkError)
        env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
        if subprocess.run(families, cwd=ROOT, env=env).returncode:
            raise cli.fail("bench/model_families.py failed (its output above)")
        print(f"the whole matrix{' (a sample)' if args.sample else ''}: {time.monotonic() - start:.0f} s")
    return 0


@contextlib.contextmanager
def time_limit(seconds: int):
    """`with time_limit(s) as limit: ... with limit(): one type`: a TimeoutError past `seconds` in one."""
    def too_long(signum, frame):
        raise TimeoutError(f"past {seconds} s")

    old = signal.signal(signal.SIGALRM, too_long)

    @contextlib.contextmanager
    def limit():
        signal.alarm(seconds)
        try:
            yield
        finally:
            signal.alarm(0)

    try:
        yield limit
    finally:
        signal.signal(signal.SIGALRM, old)


# ---- the named checkpoints ----

def checkpoint_names() -> list[str]:
    return sorted(p.parent.name for p in CHECKPOINTS.glob("*/config.json"))


def checkpoint_source(name: str) -> dict:
    """A checkpoint's config.json (bench/configs/<name>/config.json) as written."""
    return json.loads((CHECKPOINTS / name / "config.json").read_text())


def checkpoint_row(name: str, speedups: tuple[str, ...]) -> dict:
    """One checkpoint's row: the probe's cells at the run's shrink of its own config, its size, and the decoder
    layers whose MLP the memory plan counts as tiled at full size (plan/memory.py, on the meta device)."""
    from transformers import AutoConfig

    from ds_train.plan.memory import model_shape

    source = checkpoint_source(name)
    model_type = source["model_type"]
    got = row(model_type, speedups, source=source)
    shape = model_shape(AutoConfig.for_model(**source))
    got |= {"checkpoint": name, "params": shape.n_params,
            "planned": f"{shape.tiled_mlp_layers} of {shape.n_layers} layers"}
    return got


def checkpoint_table(rows: list[dict], speedups: tuple[str, ...]) -> str:
    head = ["checkpoint", "model type", "parameters", "builds", *speedups, "MLPs the plan tiles (full size)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([f"`{r['checkpoint']}`", f"`{r['type']}`", f"{r['params'] / 1e9:.2f}B",
                                        r["build"], *(r["cells"].get(s, "") for s in speedups), r["planned"]]
                                       ).replace("\n", " ") + " |")
    return "\n".join(lines)


def checkpoints_main(which: str, args, doc: Path, start: float) -> int:
    names = checkpoint_names() if which == "all" else [n for n in which.split(",") if n]
    unknown = sorted(set(names) - set(checkpoint_names()))
    if unknown:
        raise cli.fail(f"--checkpoints {','.join(unknown)}: not in {CHECKPOINTS.relative_to(ROOT)} (it has "
                       f"{', '.join(checkpoint_names())})")
    speedups = SPEEDUPS + (("compiled layers",) if args.compile else ())
    rows = []
    with time_limit(TYPE_SECONDS * (3 if args.compile else 1)) as limit:
        for name in names:
            with limit():
                rows.append(checkpoint_row(name, speedups))
            print(json.dumps(rows[-1], ensure_ascii=False), file=sys.stderr, flush=True)
    command = "python bench/models.py " + shlex.join(sys.argv[1:])
    text = f"{dated(command, time.monotonic() - start)}.\n\n{checkpoint_table(rows, speedups)}"
    print(text)
    if args.write:
        fresh = {r["checkpoint"]: r for r in rows}
        whole = which == "all" and not args.sample
        write_between(doc, CHECKPOINTS_BEGIN, CHECKPOINTS_END, text if whole else merged_checkpoints(
            fresh, speedups, text, doc))
    return 0


def merged_checkpoints(fresh: dict, speedups: tuple[str, ...], text: str, doc: Path) -> str:
    """The checkpoints' table in `doc` with these rows run again (said under it), the others kept."""
    old = doc.read_text().split(CHECKPOINTS_BEGIN, 1)[1].split(CHECKPOINTS_END, 1)[0].strip().split("\n\n")
    lines = old[1].splitlines() if len(old) > 1 else []
    columns = [c.strip() for c in lines[0].strip("|").split("|")] if lines else []
    if columns and [c for c in columns if c in SPEEDUPS + ("compiled layers",)] != list(speedups):
        raise cli.fail(f"{doc}: its checkpoints' table has the columns {columns}; run these with the same options")
    table_lines = checkpoint_table(list(fresh.values()), speedups).splitlines()
    new = {line.split("|")[1].strip(): line for line in table_lines[2:]}
    kept = [new.pop(x.split("|")[1].strip(), x) for x in lines[2:]]
    body = "\n".join(table_lines[:2] + sorted(kept + list(new.values())))
    head = old[0] if lines else text.split("\n\n")[0]
    again = "".join(f"\n\n{x}" for x in old[2:])
    return f"{head}\n\n{body}{again}\n\nRun again: {', '.join(fresh)}: {text.split(chr(10))[0].rstrip('.')}."


def commit() -> str:
    """The commit the tables are regenerated at: its short hash, and "+" where ds_train/, bench/ or the
    pinned requirements differ from it (uncommitted changes)."""
    import subprocess

    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "ds_train", "bench", "requirements.txt")
    return sha + ("+" if dirty else "")


def dated(command: str, seconds: float) -> str:
    """The line a table starts with: its command, date, commit and versions, and how long it took."""
    from importlib.metadata import version

    return (f"`{command}`, {date.today().isoformat()}, commit {commit()}, transformers {version('transformers')}, "
            f"torch {version('torch')}, DeepSpeed {version('deepspeed')}; {seconds:.0f} s on this 2-core CPU")


def merged(rows: list[dict], speedups: tuple[str, ...], text: str, doc: Path = DOC, some: bool = False) -> str:
    """The table in `doc` with these types' rows run again (said under it), the others kept, the counts
    recounted over every row. `some`: only the columns `speedups` were run again (--columns), the other cells of
    each row kept."""
    old = doc.read_text().split(BEGIN, 1)[1].split(END, 1)[0].strip().split("\n\n")
    lines = old[1].splitlines()
    columns = [c.strip() for c in lines[0].strip("|").split("|")]
    theirs = [c for c in columns if c in SPEEDUPS + ("compiled layers",) + RUN_COLUMNS]
    if (set(speedups) - set(theirs)) if some else theirs != list(speedups):
        raise cli.fail(f"{doc}: its table has the columns {columns}; run these types with the same options")
    fresh = {r["type"]: r for r in rows}
    every = []
    for line in lines[2:]:
        cells = dict(zip(columns, (c.strip() for c in line.strip().strip("|").split(" | "))))
        kind = cells["model type"].strip("`")
        was = {"type": kind, "build": cells["builds"], "moved": [cells["moved off identity"]]
               if cells["moved off identity"] else [], "cells": {c: cells[c] for c in theirs}}
        new = fresh.pop(kind, None)
        every.append(was if new is None else new | {"cells": was["cells"] | new["cells"]} if some else new)
    every += fresh.values()  # a type the table did not have
    speedups = tuple(theirs) if some else speedups
    every.sort(key=lambda r: r["type"])
    head = old[0].split(" on this 2-core CPU. ")[0]
    again = "".join(f"\n\n{x}" for x in old[2:])  # the rows run again before
    which = "every type" if len(rows) > 20 else ", ".join(r["type"] for r in rows)
    return (f"{head} on this 2-core CPU. {counts(every)}.\n\n{table(every, speedups)}{again}\n\nRun again: "
            f"{which}{' (' + ', '.join(s for s in speedups if any(s in r['cells'] for r in rows)) + ')' if some else ''}"
            f": {text.split('. ', 1)[0]}.")


def write_between(doc: Path, begin: str, end: str, text: str) -> None:
    """`text` into `doc` between its `begin` and `end` markers, in place of what was there."""
    old = doc.read_text()
    if begin not in old or end not in old:
        raise cli.fail(f"{doc}: no {begin} ... {end} markers to write the table between")
    doc.write_text(old[:old.index(begin) + len(begin)] + "\n" + text + "\n" + old[old.index(end):])


def report(rows: list[dict], speedups: tuple[str, ...], seconds: float, command: str) -> str:
    return f"{dated(command, seconds)}. {counts(rows)}.\n\n{table(rows, speedups)}"


if __name__ == "__main__":
    sys.exit(cli.run(main))
