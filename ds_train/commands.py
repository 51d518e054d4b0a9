"""What each subcommand does: `ds_train/__main__.py` parses the command line and calls one of these.

Each imports what it needs when it runs, so `ds-train --help` and the launcher's own checks stay fast.
"""

from __future__ import annotations

from pathlib import Path

from ds_train.errors import UserError


def cmd_train(args) -> int:
    """train a causal LM (under deepspeed, torchrun or alone)

    Train. Overrides are dotted keys: train.max_steps=20 optim.lr=3e-4. --help-config lists every key."""
    from ds_train.config.file import load_config
    from ds_train.launch.packages import check_imports, run_modules

    cfg = load_config(args.config, args.overrides, command="train")
    check_imports(run_modules(cfg))  # before the loop's imports: a package that fails to import is one line

    from ds_train.train.loop import train

    train(cfg, args.ds_config)
    return 0


def cmd_ript(args) -> int:
    """RIPT post-training: RLOO with dynamic rollout sampling

    Post-train a policy (model.path: a Hugging Face directory or a ds_train run directory) on the tasks
    of the ript section. Overrides as for train; --help-config lists every key."""
    from ds_train.config.file import load_config
    from ds_train.launch.packages import check_imports, run_modules

    cfg = load_config(args.config, args.overrides, command="ript")
    check_imports(run_modules(cfg))  # before the loop's imports: a package that fails to import is one line

    from ds_train.ript.trainer import ript

    ript(cfg, args.ds_config)
    return 0


def train_spec_of(cfg):
    """The RunSpec of `train` (the launch preflight checks the batch math with it)."""
    from ds_train.train.loop import train_spec

    return train_spec(cfg)


def ript_spec_of(cfg):
    from ds_train.ript.trainer import ript_spec

    return ript_spec(cfg)


def cmd_prepare(args) -> int:
    """tokenise text, JSONL, parquet or datasets sources into train.bin / val.bin / meta.json, streaming, on every core

    Tokenise SOURCE... into --out (or the data section of --config into its data.dir): train.bin,
    val.bin and meta.json (sft: the target masks and example offsets too), streaming, on every core."""
    from ds_train.config.file import load_config
    from ds_train.data.meta import META, load_meta
    from ds_train.data.prepare import prepare
    from ds_train.inputs import model_dirs, tokenizer_dir

    if args.workers is not None and args.workers < 0:
        raise UserError(f"prepare: --workers {args.workers}: give 0 (one per core) or more")
    if args.config:
        cfg = load_config(args.config, args.overrides, command="prepare")  # a train run's config
        d, out = cfg.data, cfg.data.dir
        tokenizer = tokenizer_dir(cfg, model_dirs(cfg)[0])  # the tokenizer `train` checks the data against
        prepare(d.sources, d.dir, tokenizer, d.vocab_size, d.val_fraction, d.text_key, fmt=d.format,
                chat_template=d.chat_template, split_digits=d.split_digits,
                workers=args.workers if args.workers is not None else d.workers, overwrite=args.overwrite)
    else:
        if not args.sources or not args.out:
            raise UserError("prepare: give SOURCE... --out DIR, or --config C (uses its data section)")
        if args.overrides:
            raise UserError("prepare: key=value overrides need --config")
        out = args.out
        template = ""
        if args.chat_template:
            try:
                template = open(args.chat_template, encoding="utf-8").read()
            except (OSError, UnicodeDecodeError) as e:
                raise UserError(f"prepare: --chat-template {args.chat_template!r} cannot be read ({e}); give a "
                                f"file holding a Jinja chat template") from None
        prepare(args.sources, out, args.tokenizer, args.vocab_size, args.val_fraction, args.text_key,
                fmt=args.format, chat_template=template, split_digits=args.split_digits, workers=args.workers or 0,
                overwrite=args.overwrite)
    meta = load_meta(out)
    print(f"prepare: wrote {out}/train.bin ({meta['train_tokens']:,} tokens), val.bin "
          f"({meta['val_tokens']:,} tokens), {META}; vocab {meta['vocab_size']} ({meta['dtype']}); "
          f"tokenizer {meta['tokenizer']}")
    return 0


def cmd_convert(args) -> int:
    """convert a checkpoint with DeepSpeed's ds_to_universal

    Convert a checkpoint (run dir, checkpoints dir or tag dir) into DeepSpeed's universal format,
    loadable at any world size and ZeRO stage. Resume does this by itself when they change."""
    from ds_train.checkpoint.resume import convert_to_universal, find_resume, newer_incomplete
    from ds_train.checkpoint.rundir import RunPaths

    source = Path(args.source)
    if not source.is_dir():
        raise UserError(f"convert: {str(source)!r} is not a directory; give a run directory, its checkpoints/ "
                        f"or a tag directory")
    ckpt_dir = RunPaths(source).checkpoints if RunPaths(source).checkpoints.is_dir() else source
    point = find_resume(args.tag or str(ckpt_dir), ckpt_dir, key="convert")
    if point is None:
        raise UserError(f"convert: no checkpoint found in {str(source)!r}")
    skipped = newer_incomplete(point) if not args.tag else []
    if skipped:
        print(f"note: converting {point.tag}, the newest complete checkpoint; skipped: {', '.join(skipped)}")
    out = convert_to_universal(point.load_dir / point.tag)
    print(f"convert: wrote {out} (DeepSpeed universal checkpoint); resume from it at any world size with "
          f"checkpoint.resume={out}")
    return 0


def cmd_export(args) -> int:
    """write a Hugging Face model directory from a checkpoint

    Export a checkpoint (ZeRO 0-3; AutoTP's shards and AutoEP's experts gathered into the model's own
    layout) as config.json, model.safetensors (sharded when large; in the run's dtype, bf16 stays bf16, which
    config.json's dtype records), generation_config.json and the tokenizer. A LoRA run (model.lora) exports
    its adapters as a peft directory (adapter_config.json, adapter_model.safetensors) on its base, or with --merge one model
    with the adapters merged in."""
    from ds_train.checkpoint.export import export, resolve_source
    from ds_train.checkpoint.lora_export import export_lora, run_lora

    src = resolve_source(args.source, args.tag)
    lora = run_lora(src)[0]
    if lora is None and not args.merge:
        out = export(args.source, args.out, args.tag, args.max_shard_size)
    else:
        out = export_lora(args.source, args.out, args.tag, args.merge, args.max_shard_size)
    if src.passed_over:
        print(f"export: took {src.tag}, the newest complete tag; {src.passed_over}")
    if lora is not None and not args.merge:
        print(f"export: wrote {out} from {src.tag}: a peft LoRA adapter (PeftModel.from_pretrained(base, "
              f"{str(out)!r}); --merge writes one merged model)")
    else:
        print(f"export: wrote {out} from {src.tag}: a Hugging Face model directory "
              f"(AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


def cmd_eval(args) -> int:
    """score a run directory or a Hugging Face export on lm-evaluation-harness tasks

    PATH is an export (a Hugging Face model directory, or a LoRA run's peft adapter directory) or a run directory:
    its newest complete checkpoint (or --tag) is exported first into a temporary directory, a LoRA run's adapters
    merged. The tasks and options are the run's benchmarks section (a run directory's config.yaml), or the flags.
    Scored in this process through lm_eval's Hugging Face backend, as `lm_eval --model hf` scores the export;
    writes lm_eval's results file (OUT/<model>/results_<time>.json, as `lm_eval --output_path OUT` does; OUT
    defaults to PATH/lm_eval) and prints lm_eval's table."""
    import tempfile
    from dataclasses import replace

    from ds_train.benchmarks import check_gen_kwargs, check_tasks, evaluate, write_results
    from ds_train.config.benchmarks import BenchmarksConfig
    from ds_train.config.file import load_config

    path = Path(args.path)
    if not path.is_dir():
        raise UserError(f"eval: {str(path)!r} is not a directory; give a run directory (output_dir) or a Hugging Face "
                        f"model directory (`ds-train export`'s)")
    exported = (path / "config.json").is_file() or (path / "adapter_config.json").is_file()
    bench = BenchmarksConfig()
    if not exported and (path / "config.yaml").is_file():
        bench = load_config(path / "config.yaml", []).benchmarks
    flags = {"tasks": [t for t in (args.tasks or "").split(",") if t] or None, "limit": args.limit,
             "batch_size": args.batch_size, "num_fewshot": args.num_fewshot}
    bench = replace(bench, **{k: v for k, v in flags.items() if v is not None})
    if not bench.tasks:
        raise UserError(f"eval: no tasks: {path} names none (its benchmarks.tasks), so give --tasks NAME[,NAME...] "
                        f"(lm_eval's names, recipes/lm_eval/'s, or task YAML paths)")
    scored = ""  # which tag of a run directory, and what newer was passed over
    if not exported:  # the path and tag said wrong before lm_eval's index of tasks is built (seconds)
        from ds_train.checkpoint.export import resolve_source

        src = resolve_source(path, args.tag)
        scored = f" at {src.tag}" + (f" ({src.passed_over})" if src.passed_over else "")
    else:
        _has_weights(path)
    check_gen_kwargs(bench.gen_kwargs)
    tasks = check_tasks(bench.tasks, "--tasks" if flags["tasks"] else "benchmarks.tasks",
                        unsafe_code=bench.confirm_run_unsafe_code)
    with tempfile.TemporaryDirectory(prefix="ds_train_eval_") as tmp:
        model_dir = path if exported else _export_for_eval(path, args.tag, src, Path(tmp) / "export")
        model, tokenizer, device = _load_for_eval(model_dir)
        results = evaluate(model, tokenizer, bench, tasks, device)
    from lm_eval.utils import make_table

    out = write_results(results, Path(args.out) if args.out else path / "lm_eval", str(path))
    print(make_table(results))
    print(f"eval: {', '.join(tasks.names)} on {path}{scored}: lm_eval's results in {out}")
    return 0


def _export_for_eval(run: Path, tag: str | None, src, out: Path) -> Path:
    """The tag `src` (resolve_source's) exported as `lm_eval --model hf` loads it: a LoRA run's adapters merged."""
    from ds_train.checkpoint.export import export
    from ds_train.checkpoint.lora_export import export_lora, run_lora

    if run_lora(src)[0] is not None:
        return export_lora(run, out, tag, merge=True)
    return export(run, out, tag)


def _has_weights(model_dir: Path) -> None:
    """An export holds weights (a peft adapter directory its adapter's), or one line saying what to give."""
    from ds_train.model.weights import REFETCH, weight_files

    if model_dir.name == "hf_model" and (model_dir.parent / "config.yaml").is_file():  # a run's: no weights
        raise UserError(f"eval: {str(model_dir)!r} is a run's model config and tokenizer, not an export; give the run "
                        f"directory {str(model_dir.parent)!r}, or `ds-train export` it first")
    if (model_dir / "adapter_config.json").is_file():
        if not any((model_dir / f"adapter_model.{ext}").is_file() for ext in ("safetensors", "bin")):
            raise UserError(f"eval: {str(model_dir)!r} holds no adapter weights (adapter_model.safetensors); "
                            f"{REFETCH}")
        return
    weight_files(model_dir, "eval")


def _load_for_eval(model_dir: Path):
    """The export as `lm_eval --model hf` loads it (its dtype, auto: the config's), on a GPU where there is one;
    a peft adapter directory on its base, merged."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from safetensors import SafetensorError

    from ds_train.model.hfconfig import said

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        if (model_dir / "adapter_config.json").is_file():
            from peft import AutoPeftModelForCausalLM

            model = AutoPeftModelForCausalLM.from_pretrained(model_dir, dtype="auto").merge_and_unload()
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:  # a damaged directory's
        raise UserError(f"eval: {str(model_dir)!r} does not load as a causal LM ({said(e, 200)}); re-export it "
                        f"(`ds-train export RUN_DIR --out DIR`) or give the run directory") from None
    return model.to(device), tokenizer, device


def cmd_monitor(args) -> int:
    """watch a run from its directory: progress, curves, ranks

    A live view of a run (in progress or ended) from its output_dir alone, read-only: progress and ETA,
    loss / eval loss / lr curves, tokens/s and MFU, one row per rank (host, step, phase, heartbeat age,
    memory, GPU use) with stalled ranks and stragglers marked; RIPT runs show success per task. Ends
    when the run ends, saying how and why."""
    from ds_train.observe.monitor import monitor

    return monitor(args.run_dir, args.interval, args.once)


def cmd_doctor(args) -> int:
    """what went wrong in a run or a log, and what to do

    Read a run directory (its rank logs, hang and failure reports, metrics) or any log (pdsh or SLURM
    output) and name what went wrong: CUDA or CPU out of memory, a killed rank, NCCL errors and
    timeouts, a port in use, ssh / pdsh, a module missing on a node, wandb login, rendezvous, disk
    full, non-finite loss, a hang, bad input; causes first, each with fixes. Exit 0: nothing wrong
    found; 1: a problem found."""
    from ds_train.observe.doctor import doctor

    return doctor(args.paths)


def cmd_plot(args) -> int:
    """PNG plots of one run or several overlaid

    Plot metrics.jsonl: loss and eval loss against steps and tokens, lr, tokens/s and memory per rank
    (RIPT: success per task and held-out success), and lm-evaluation-harness scores where the run has them (the
    benchmarks section). Several run directories are overlaid."""
    from ds_train.observe.plots import write_plots
    from ds_train.checkpoint.rundir import read_run

    views = []
    for run_dir in args.run_dirs:
        view = read_run(run_dir)
        if not Path(run_dir).is_dir() or not view.metrics:
            raise UserError(f"plot: {run_dir!r} holds no metrics.jsonl records; give run directories (output_dir)")
        views.append(view)
    kinds = {v.kind for v in views}
    if len(kinds) > 1:
        raise UserError(f"plot: give runs of one kind ({' or '.join(sorted(k.name for k in kinds))} runs, not "
                        f"both: their metrics differ)")
    labels = [Path(v.path).resolve().name for v in views]
    if len(set(labels)) < len(labels):
        labels = [str(v.path) for v in views]
    out = Path(args.out) if args.out else (views[0].path / "plots" if len(views) == 1 else Path("plots"))
    paths = write_plots([(label, v.metrics) for label, v in zip(labels, views)], out, kinds.pop())
    print(f"plot: wrote {', '.join(str(p) for p in paths)}")
    return 0


def _plan_inputs(args):
    from ds_train.config.file import load_config
    from ds_train.estimate import target_from_args

    cfg = load_config(args.config, args.overrides, command=args.command)  # estimate, dry-run
    return cfg, target_from_args(args.hostfile, args.nodes, args.gpus_per_node, args.gpu_memory)


def cmd_estimate(args) -> int:
    """per-GPU memory for a target cluster, ZeRO 0-3 side by side

    Memory plan without an accelerator (the model is built on the meta device): model states by ZeRO
    stage and offload, activations with and without checkpointing, DeepSpeed's buffers; what fits."""
    from ds_train.estimate import estimate_outcome, format_estimate, run_estimate

    cfg, target = _plan_inputs(args)
    out = run_estimate(cfg, args.ds_config, target, args.preset)
    print(format_estimate(out, target))
    print(estimate_outcome(out, target))
    return 0


def cmd_dry_run(args) -> int:
    """rehearse the cluster job on this one device

    Run a few real steps of one rank's share of the target batch on this device; predict per-GPU peak
    memory, throughput, MFU and time to finish on the target cluster; check a checkpoint round trip."""
    from ds_train.dryrun import dry_run, dry_run_outcome, format_dry_run, write_json
    from ds_train.checkpoint.rundir import RunPaths

    cfg, target = _plan_inputs(args)
    out = dry_run(cfg, args.ds_config, target)
    path = Path(args.out) if args.out else RunPaths(cfg.output_dir).dry_run
    write_json(out, path)
    print(format_dry_run(out, target))
    print(dry_run_outcome(out, target, path))
    return 0 if out["checkpoint_round_trip"]["ok"] else 1




def _items(values: list[str], flag: str, overrides: list[str]) -> list[str]:
    """An option's values, with the key=value overrides argparse let it swallow moved to `overrides`."""
    overrides += [v for v in values if "=" in v]
    return [v for v in values if "=" not in v]


def cmd_parity(args) -> int:
    """prove a layout keeps the math: N steps against a one-process fp32 reference

    Run --steps optimizer steps of each layout (each --ds-config's ZeRO stage and the run's dtype, at
    each --nproc world size and --grad-accum accumulation) and of a reference (one process, ZeRO-0,
    fp32, eager layers, the same global batch through accumulation, the same data order and initial weights); print
    per step both losses and gradient norms and their relative differences, the held-out loss, and a
    verdict. Exit 0 within the tolerances, 1 past them. In bf16/fp16 the tolerances come from a
    measured noise floor: the reference run again in that precision. TF32 is off in the fp32 runs
    unless --tf32. The layouts of one world size share one launch. key=value overrides as for train."""
    from ds_train.config.file import load_config
    from ds_train.parity import parity

    overrides = list(args.overrides)
    ds_configs = _items(args.ds_config, "--ds-config", overrides)
    numbers = {}
    for flag, values in (("--nproc", args.nproc), ("--grad-accum", args.grad_accum), ("--sequence", args.sequence),
                         ("--tensor", args.tensor), ("--expert", args.expert)):
        items = _items(values, flag, overrides)
        bad = [v for v in items if not v.isdigit() or int(v) <= 0]
        if bad:
            raise UserError(f"parity: {flag} {' '.join(bad)}: give positive whole numbers")
        numbers[flag] = [int(v) for v in items]
    if not ds_configs:
        raise UserError("parity: --ds-config needs at least one DeepSpeed JSON (ds_configs/zero*.json)")
    cfg = load_config(args.config, overrides, command="parity")
    label = args.config + (f" {' '.join(overrides)}" if overrides else "")
    return parity(cfg, label, ds_configs, numbers["--nproc"] or [2], numbers["--grad-accum"], args.steps, args.shrink,
                  args.out or "", args.launcher_args, args.loss_tol, args.grad_tol, numbers["--sequence"],
                  numbers["--tensor"], args.tf32, numbers["--expert"])


def cmd_parity_worker(args) -> int:
    from ds_train.parity import run_jobs

    return run_jobs(args.plan)
