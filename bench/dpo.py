"""Preference training (DPO) on the generated pairs (recipes/dpo.yaml): how soon the reward accuracy on
held-out pairs reaches 0.95, for each loss.

    python bench/dpo.py [--losses sigmoid,ipo,sigmoid_norm] [--steps N] [--out FILE.json] [--write] [--reduced]

Each loss is a real `deepspeed --num_gpus 2` launch of recipes/dpo.yaml (ZeRO-2, from runs/quickstart,
which `bash scripts/quickstart.sh` makes; the reference log-probs precomputed once into data.dir and
read by the later launches), evaluating every 25 steps on held-out pairs (eval/rewards/accuracies).
The seconds are those a user waits: from the launch to the evaluation, start-up and the reference
pass included. The final figure is then checked apart from the run: the bench loads the exported
model, computes every held-out pair's log-probs itself and its rewards against the stored
reference log-probs, per kind of pair. --write rewrites the dpo-bench blocks of docs/fine_tuning.md
and BENCHMARKS.md. --reduced: the first loss alone, 2 steps, evaluated on one batch at the end, and
nothing written into docs/fine_tuning.md or BENCHMARKS.md: the CPU check that the bench runs end to
end (tests/test_doc_commands.py), measuring nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import cli  # noqa: E402
from bench.rl_vs_sft import machine, rewrite, versions  # noqa: E402

RECIPE = ROOT / "recipes" / "dpo.yaml"
FIGURES = ROOT / "docs" / "fine_tuning.md"  # the page with the dpo-bench block
KINDS = {"Tell me about my friend": "tone", "How do I": "refusal", "Describe the": "repetition",
         "Write a greeting": "faithful"}
TARGET = 0.95
REDUCED_STEPS, REDUCED = 2, ("train.eval_batches=1",)  # --reduced
# The recipe's command as README.md and docs/fine_tuning.md show it: each loss launches it, with overrides.
COMMAND = "deepspeed --num_gpus 2 --module ds_train train --config recipes/dpo.yaml --ds-config ds_configs/zero2.json"


def launch(loss: str, steps: int, out_dir: Path, log: Path, extra: tuple[str, ...] = ()) -> tuple[float, str]:
    """COMMAND (the venv's launcher) with this loss's overrides, from the repository root."""
    cmd = [str(Path(sys.executable).parent / "deepspeed"), *COMMAND.split()[1:],
           f"output_dir={out_dir}", f"dpo.loss={loss}", *([f"train.max_steps={steps}"] if steps else []),
           "checkpoint.resume=restart",
           "checkpoint.export_final=true", "log.progress=false", "log.plots=false", *extra]
    start = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    text = log.read_text()
    if rc:
        raise cli.fail(f"{' '.join(cmd)} failed (exit {rc}); see {log}")
    return start, text


def heldout(model_dir: str, data_dir: Path, stored: Path, loss: str, beta: float, micro: int = 16) -> dict:
    """Every held-out pair's rewards from the exported model and the stored reference log-probs."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ds_train.data.examples import IGNORE
    from ds_train.data.pairs import PreferenceData
    from ds_train.data.meta import load_meta
    from ds_train.config.registry import PREFERENCE_LOSSES
    from ds_train.train.preference import sequence_logps

    meta = load_meta(data_dir)
    val = PreferenceData(data_dir, "val", meta["dtype"], 128, 0, "drop", meta["eos_token_id"])
    ref = np.load(stored)["val"]
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(data_dir / meta["tokenizer"])
    right, seen = {}, {}
    for i in range(0, len(val.kept), micro):
        batch = val.samples_of(val.kept[i:i + micro])
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(batch.inputs)).logits
        logps, counts = sequence_logps(logits, torch.from_numpy(batch.targets))
        rows = np.concatenate([2 * batch.pairs, 2 * batch.pairs + 1])
        base = torch.from_numpy(ref[rows])
        if PREFERENCE_LOSSES.entry(loss).normalised:
            logps, base = logps / counts, base / counts
        rewards = beta * (logps.double() - base)
        m = len(batch.pairs)
        for j in range(m):
            prompt = tok.decode([t for t, y in zip(batch.inputs[j], batch.targets[j]) if y == IGNORE])
            kind = next((k for s, k in KINDS.items() if s in prompt), "other")
            seen[kind] = seen.get(kind, 0) + 1
            right[kind] = right.get(kind, 0) + int(rewards[j] > rewards[m + j])
    return {"pairs": sum(seen.values()), "accuracy": sum(right.values()) / sum(seen.values()),
            "by_kind": {k: right[k] / seen[k] for k in sorted(seen)}}


def one(loss: str, steps: int, work: Path, extra: tuple[str, ...] = ()) -> dict:
    import yaml

    out = work / loss
    log = work / f"{loss}.log"
    start, text = launch(loss, steps, out, log, extra)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["time"] - start, r["eval/rewards/accuracies"]) for r in records
             if "eval/rewards/accuracies" in r]
    reached = next(((s, t) for s, t, a in evals if a >= TARGET), None)
    said = re.findall(r"reference log-probs: (?:read from|.* pairs in) (\S+\.npz)", text)
    if not evals or not said:
        raise cli.fail(f"the {loss} run logged {'no evaluation' if not evals else 'no reference log-probs line'}; "
                       f"see {log}")
    stored = Path(said[-1])
    cfg = yaml.safe_load(RECIPE.read_text())
    results = json.loads((out / "results.json").read_text())
    check = heldout(results["export"], ROOT / cfg["data"]["dir"], stored, loss, cfg["dpo"]["beta"])
    said = re.search(r"data: preference, ([^\n]*)", text)
    return {"loss": loss, "steps": steps or cfg["train"]["max_steps"], "evals": evals, "reached": reached,
            "final_eval": evals[-1][2],
            "job_s": records[-1]["time"] - start, "heldout": check, "data": said.group(1) if said else "",
            "computed_reference": "computing them" in text}


def tables(rows: list[dict], command: str) -> tuple[str, str]:
    head = ("| loss | held-out reward accuracy >= 0.95 at | eval accuracy at the end | "
            "independent check (all held-out pairs) | by kind |\n|---|---|---|---|---|\n")
    body = ""
    for r in rows:
        at = f"step {r['reached'][0]}, {r['reached'][1]:.0f} s" if r["reached"] else "not reached"
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in r["heldout"]["by_kind"].items())
        body += (f"| {r['loss']} | {at} | {r['final_eval']:.3f} (step {r['steps']}, {r['job_s']:.0f} s) | "
                 f"{r['heldout']['accuracy']:.3f} of {r['heldout']['pairs']} | {kinds} |\n")
    when = time.strftime("%Y-%m-%d")
    doc = f"Measured {when} on {machine()}, `{command}`:\n\n{head}{body}"
    section = (f"{when}, {machine()}, {versions()}; `{command}`. Data: {rows[0]['data']}. Seconds from the "
               f"launch (start-up and the reference pass included).\n\n{head}{body}")
    return doc, section


def main() -> None:
    ap = cli.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--losses", default="sigmoid,ipo,sigmoid_norm")
    ap.add_argument("--steps", type=int, default=0, help="train.max_steps (default: the recipe's)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench_dpo"))
    ap.add_argument("--out", default="")
    ap.add_argument("--write", action="store_true", help="rewrite the dpo-bench blocks of docs/fine_tuning.md and "
                                                          "BENCHMARKS.md")
    ap.add_argument("--reduced", action="store_true", help="the first loss, 2 steps, nothing written into "
                                                           "docs/fine_tuning.md or BENCHMARKS.md: the CPU check "
                                                           "that the bench runs")
    args = ap.parse_args()
    if not (ROOT / "runs" / "quickstart" / "checkpoints").is_dir():
        raise cli.fail("runs/quickstart is missing; run `bash scripts/quickstart.sh` first")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    losses = args.losses.split(",")[:1] if args.reduced else args.losses.split(",")
    steps = REDUCED_STEPS if args.reduced else args.steps
    rows = [one(loss, steps, work, REDUCED if args.reduced else ()) for loss in losses]
    for r in rows:
        print(json.dumps(r))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    command = "python bench/dpo.py" \
        + (f" --losses {args.losses}" if args.losses != "sigmoid,ipo,sigmoid_norm" else "") \
        + (f" --steps {args.steps}" if args.steps else "") + (" --reduced" if args.reduced else "")
    doc, section = tables(rows, command)
    print(doc)
    if args.write and not args.reduced:
        rewrite(FIGURES, "dpo-bench", doc)
        rewrite(ROOT / "BENCHMARKS.md", "dpo-bench", section)
        print(f"rewrote the dpo-bench blocks of {FIGURES.relative_to(ROOT)} and BENCHMARKS.md")


if __name__ == "__main__":
    sys.exit(cli.run(main))
