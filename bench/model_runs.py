"""The model-type matrix's one-process columns (bench/models.py --runs): each model type, at the probe's size
and settings, through ds_train's own run machinery in this process (as `ds-train parity`'s worker runs its
jobs: build_run and the training loop, a DeepSpeed engine on one gloo rank, ZeRO-0, fp32):

  trains   2 optimizer steps on the bundled corpus's tokens, a checkpoint after each, the losses finite
  export   `ds-train export` of the last tag, reloaded with `from_pretrained`: no missing or unexpected key,
           its logits the engine's within 1e-5 (relative to the largest)
  resume   a second run from the first tag: its second step's loss and its final logits bitwise the first run's
           (≈: not bitwise, and neither are two straight runs of the model: its own backward is not deterministic;
           where straight runs agree and the resumed one's update does not, both again at one thread, bitwise)
  LoRA     the default targets (model.lora.target_modules: [all-linear]) adapt some layers and, after one
           backward, only the adapters have gradients, some non-zero

A cell is ✓ (with what it measured), or the one line a user gets (a refusal), or what failed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

RUN_COLUMNS = ("trains", "export", "resume", "LoRA")  # as bench/models.py names them
TOLERANCE = 1e-5


def corpus(out: Path) -> Path:
    """The bundled corpus (a slice of the stdlib) prepared with a 512-token BPE, once per matrix run."""
    from ds_train.data.prepare import prepare
    from ds_train.data.sources import python_stdlib_files

    data = out / "data"
    if not (data / "meta.json").is_file():
        (out / "corpus").mkdir(parents=True, exist_ok=True)
        for i, path in enumerate(python_stdlib_files(max_bytes=200_000)):
            shutil.copy(path, out / "corpus" / f"{i:04d}_{path.name}")
        prepare([str(out / "corpus")], data, vocab_size=512, val_fraction=0.1)
    return data


def run_config(model: dict, data: Path, out: Path, resume: str = "auto") -> dict:
    attention = model.pop("attn_implementation", "sdpa")  # eager where the model has no sdpa (run_cells)
    return {"output_dir": str(out), "seed": 7,
            "model": {"config": model, "dtype": "fp32", "compile": False, "attn_implementation": attention},
            "data": {"dir": str(data)},
            "train": {"max_steps": 2, "micro_batch_size": 2, "global_batch_size": 2, "seq_len": 32,
                      "eval_every": 0, "eval_batches": 1},
            "optim": {"lr": 1e-3, "warmup_steps": 0},
            "checkpoint": {"every": 1, "keep": 0, "save_final": False, "resume": resume},
            "log": {"every": 1, "progress": False, "sample_prompt": "", "plots": False}}


def train(raw: dict, ids):
    """One ds_train run of `raw` in this process: its logged losses and its final logits on `ids`."""
    import torch

    from ds_train import topology
    from ds_train.config.file import build_config
    from ds_train.inputs import check_inputs
    from ds_train.observe.logs import release_console
    from ds_train.start import build_run
    from ds_train.train.loop import run_training, train_spec

    cfg = build_config(raw, source="bench/models.py")
    inputs = check_inputs(cfg, str(Path(__file__).resolve().parents[1] / "ds_configs" / "zero0.json"))
    sys.stdout.flush()
    table = os.dup(1)
    os.dup2(2, 1)  # the run's step lines to stderr: stdout is the matrix's
    try:
        with build_run(inputs, topology.detect_env(), train_spec(cfg, keep_group=True), quiet=True) as run:
            run_training(run, inputs.data)
            run.engine.module.eval()
            with torch.no_grad():
                logits = run.engine.module(input_ids=ids, use_cache=False).logits.float()
    finally:
        release_console()  # the run's copy of stdout and stderr into its logs ends with it
        sys.stdout.flush()
        os.dup2(table, 1)
        os.close(table)
    lines = (Path(raw["output_dir"]) / "metrics.jsonl").read_text().splitlines()
    losses = {r["step"]: r["train/loss"] for r in map(json.loads, lines) if "train/loss" in r}
    return losses, logits


def run_cells(model_type: str, model: dict, data: Path, scratch: Path) -> dict:
    """The one-process cells of a model type (see the module); `model`: its run config's model.config."""
    import torch

    from ds_train.errors import UserError

    cells = {}
    model = within_corpus_vocabulary(model)
    ids = torch.arange(2 * 16).reshape(2, 16) * 7 % 512
    first = scratch / "first"
    try:
        try:
            losses, logits = train(run_config(dict(model), data, first), ids)
        except UserError as e:  # the one line a user gets; the model trains with the attention it has
            if "model.attn_implementation: 'sdpa' cannot be used" not in str(e):
                raise
            model = {**model, "attn_implementation": "eager"}
            losses, logits = train(run_config(dict(model), data, first), ids)
        if sorted(losses) != [1, 2] or not all(map(torch.isfinite, map(torch.tensor, losses.values()))):
            raise RuntimeError(f"logged losses {losses}")
        cells["trains"] = f"✓ {losses[1]:.3f} → {losses[2]:.3f}" + (
            " (model.attn_implementation=eager)" if model.get("attn_implementation") == "eager" else "")
    except UserError as e:
        said = " ".join(str(e).replace(str(scratch), "RUN").split())
        return {c: f"refused: {said[:160]}" for c in RUN_COLUMNS}
    except Exception as e:  # noqa: BLE001 - the cell says what failed
        return {c: f"fails: {short(e)}".replace(str(scratch), "RUN") for c in RUN_COLUMNS}
    cells["export"] = _cell(lambda: exported(first, scratch / "hf", ids, logits))
    cells["resume"] = _cell(lambda: resumed(model, data, first, scratch / "resumed", ids, losses, logits))
    cells["LoRA"] = _cell(lambda: lora(model))
    return {k: v.replace(str(scratch), "RUN") for k, v in cells.items()}


def within_corpus_vocabulary(model: dict) -> dict:
    """`model` with its special token ids (pad, bos, eos, ...; its sub-models' too) below the corpus's 512 tokens: the
    run gives the model the tokenizer's vocabulary, and refuses an id outside it (mllama's pad id, cut to 1023 for
    the probe)."""
    def cut(part: dict) -> dict:
        out = {}
        for k, v in part.items():
            if k.endswith("_token_id") and isinstance(v, int) and v >= 512:
                v = 511
            elif k.endswith("_token_id") and isinstance(v, list):
                v = sorted({min(i, 511) if isinstance(i, int) else i for i in v})
            elif k.endswith("_config") and isinstance(v, dict):
                v = cut(v)
            out[k] = v
        return out

    return cut(model)


def _cell(check) -> str:
    from ds_train.errors import UserError

    try:
        return check()
    except UserError as e:
        return f"refused: {' '.join(str(e).split())[:160]}"
    except Exception as e:  # noqa: BLE001 - the cell says what failed
        return f"fails: {short(e)}"


def exported(run_dir: Path, out: Path, ids, engine) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    from ds_train.checkpoint.export import export

    export(run_dir, out)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    if any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")):
        raise RuntimeError(f"from_pretrained: {({k: sorted(v)[:3] for k, v in info.items() if v})}")
    with torch.no_grad():
        logits = model.eval()(input_ids=ids, use_cache=False).logits.float()
    diff = float((logits - engine).abs().max() / engine.abs().max().clamp_min(1e-30))
    if not diff <= TOLERANCE:
        raise RuntimeError(f"logits {diff:.1e} off the engine's")
    return f"✓ {diff:.0e}"


def resumed(model: dict, data: Path, first: Path, out: Path, ids, losses: dict, logits) -> str:
    import torch

    tag = first / "checkpoints" / "step_00000001"
    again, after = train(run_config(dict(model), data, out, resume=str(tag)), ids)
    if again.get(2) == losses[2] and torch.equal(after, logits):
        return "✓ bitwise"
    # Not bitwise: is the model's own training deterministic? A second straight run says.
    _, straight = train(run_config(dict(model), data, out.with_name("straight")), ids)
    if not torch.equal(straight, logits):
        off = float((after - logits).abs().max() / logits.abs().max())
        noise = float((straight - logits).abs().max() / logits.abs().max())
        if off <= 10 * noise:
            return f"≈ {off:.0e}: two straight runs differ too ({noise:.0e}; the model's backward is not deterministic)"
    elif again.get(2) == losses[2]:
        # Straight runs agree and the resumed one's forward too, its update not: with several threads some
        # kernels (gpt_oss's, 2026-11-29) round by how the loaded tensors lie in memory, on some tries. At one
        # thread they do not, and the resume is checked bitwise there.
        off = float((after - logits).abs().max() / logits.abs().max())
        threads = torch.get_num_threads()
        with one_thread():
            one, logits = train(run_config(dict(model), data, out.with_name("first_1_thread")), ids)
            again, after = train(run_config(dict(model), data, out.with_name("resumed_1_thread"), resume=str(
                out.with_name("first_1_thread") / "checkpoints" / "step_00000001")), ids)
        if again.get(2) == one[2] and torch.equal(after, logits):
            return (f"✓ bitwise at 1 thread ({off:.0e} off at {threads} threads on some tries: the kernels round "
                    f"there)")
    raise RuntimeError(f"step 2 loss {again.get(2)} against {losses[2]}; logits equal: {torch.equal(after, logits)}")


@contextmanager
def one_thread():
    """torch at one thread, as a run with OMP_NUM_THREADS=1 (ds_train keeps the threads that sets)."""
    import torch

    threads, said = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if said is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = said


def lora(model: dict) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_train.config.model import LoraConfig
    from ds_train.model.lora import apply_lora, check_lora

    model = dict(model)
    attention = model.pop("attn_implementation", "sdpa")
    hf = AutoConfig.for_model(**model)
    spec = LoraConfig(rank=4)
    check_lora(spec, hf)
    torch.manual_seed(0)
    adapted = apply_lora(AutoModelForCausalLM.from_config(hf, attn_implementation=attention), spec, 0)
    adapted.train()
    ids = torch.arange(16).reshape(1, 16) * 5 % 512
    adapted(input_ids=ids, use_cache=False).logits.float().square().mean().backward()
    with_grad = [n for n, p in adapted.named_parameters() if p.grad is not None]
    layers = {n.rsplit(".lora_", 1)[0] for n in with_grad if ".lora_" in n}
    if not layers or any(".lora_" not in n for n in with_grad):
        raise RuntimeError(f"gradients on {with_grad[:3]}")
    if not any(float(p.grad.abs().sum()) > 0 for n, p in adapted.named_parameters() if p.grad is not None):
        raise RuntimeError("every adapter's gradient is zero")
    return f"✓ {len(layers)} layers"


def short(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:120]}"
