"""What each subcommand does: `ds_train/__main__.py` parses the command line and calls one of these.

Each imports what it needs when it runs, so `ds-train --help` and the launcher's own checks stay fast.
"""

from __future__ import annotations

from pathlib import Path

from ds_train.errors import UserError


def cmd_train(args) -> int:
    from ds_train.configfile import load_config
    from ds_train.trainer import train

    cfg = load_config(args.config, args.overrides)
    train(cfg, args.ds_config)
    return 0


def cmd_ript(args) -> int:
    from ds_train.configfile import load_config
    from ds_train.ript.trainer import ript

    cfg = load_config(args.config, args.overrides)
    ript(cfg, args.ds_config)
    return 0


def train_spec_of(cfg):
    """The RunSpec of `train` (the launch preflight checks the batch math with it)."""
    from ds_train.trainer import train_spec

    return train_spec(cfg)


def ript_spec_of(cfg):
    from ds_train.ript.trainer import ript_spec

    return ript_spec(cfg)


def cmd_prepare(args) -> int:
    from ds_train.configfile import load_config
    from ds_train.data.meta import load_meta
    from ds_train.data.prepare import prepare
    from ds_train.inputs import locate, tokenizer_dir

    if args.workers is not None and args.workers < 0:
        raise UserError(f"prepare: --workers {args.workers}: give 0 (one per core) or more")
    if args.config:
        cfg = load_config(args.config, args.overrides)
        d, out = cfg.data, cfg.data.dir
        tokenizer = tokenizer_dir(cfg, locate(cfg)[0])  # the tokenizer `train` checks the data against
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
    print(f"wrote {out}/train.bin ({meta['train_tokens']:,} tokens), val.bin "
          f"({meta['val_tokens']:,} tokens), meta.json; vocab {meta['vocab_size']} ({meta['dtype']}); "
          f"tokenizer {meta['tokenizer']}")
    return 0


def cmd_convert(args) -> int:
    from ds_train.resume import convert_to_universal, find_resume, newer_incomplete
    from ds_train.rundir import RunPaths

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
    print(f"wrote {out} (DeepSpeed universal checkpoint); resume from it at any world size with "
          f"checkpoint.resume={out}")
    return 0


def cmd_export(args) -> int:
    from ds_train.export import export, resolve_source

    tag = resolve_source(args.source, args.tag).tag
    out = export(args.source, args.out, args.tag, args.max_shard_size)
    print(f"wrote {out} from {tag}: a Hugging Face model directory "
          f"(AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0


def cmd_monitor(args) -> int:
    from ds_train.monitor import monitor

    return monitor(args.run_dir, args.interval, args.once)


def cmd_doctor(args) -> int:
    from ds_train.doctor import doctor

    return doctor(args.paths)


def cmd_plot(args) -> int:
    from ds_train.plots import write_plots
    from ds_train.rundir import read_run

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
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _plan_inputs(args):
    from ds_train.configfile import load_config
    from ds_train.dryrun import target_from_args

    cfg = load_config(args.config, args.overrides)
    return cfg, target_from_args(args.hostfile, args.nodes, args.gpus_per_node, args.gpu_memory)


def cmd_estimate(args) -> int:
    from ds_train.dryrun import format_estimate, run_estimate

    cfg, target = _plan_inputs(args)
    out = run_estimate(cfg, args.ds_config, target, args.preset)
    print(format_estimate(out, target))
    return 0


def cmd_dry_run(args) -> int:
    from ds_train.dryrun import dry_run, format_dry_run, write_json
    from ds_train.rundir import RunPaths

    cfg, target = _plan_inputs(args)
    out = dry_run(cfg, args.ds_config, target)
    path = Path(args.out) if args.out else RunPaths(cfg.output_dir).dry_run
    write_json(out, path)
    print(format_dry_run(out, target))
    print(f"wrote {path}")
    return 0 if out["checkpoint_round_trip"]["ok"] else 1




def _items(values: list[str], flag: str, overrides: list[str]) -> list[str]:
    """An option's values, with the key=value overrides argparse let it swallow moved to `overrides`."""
    overrides += [v for v in values if "=" in v]
    return [v for v in values if "=" not in v]


def cmd_parity(args) -> int:
    from ds_train.configfile import load_config
    from ds_train.parity import parity

    overrides = list(args.overrides)
    ds_configs = _items(args.ds_config, "--ds-config", overrides)
    numbers = {}
    for flag, values in (("--nproc", args.nproc), ("--grad-accum", args.grad_accum)):
        items = _items(values, flag, overrides)
        bad = [v for v in items if not v.isdigit() or int(v) <= 0]
        if bad:
            raise UserError(f"parity: {flag} {' '.join(bad)}: give positive whole numbers")
        numbers[flag] = [int(v) for v in items]
    if not ds_configs:
        raise UserError("parity: --ds-config needs at least one DeepSpeed JSON (ds_configs/zero*.json)")
    cfg = load_config(args.config, overrides)
    label = args.config + (f" {' '.join(overrides)}" if overrides else "")
    return parity(cfg, label, ds_configs, numbers["--nproc"] or [2], numbers["--grad-accum"], args.steps, args.shrink,
                  args.out or "", args.launcher_args, args.loss_tol, args.grad_tol)


def cmd_parity_worker(args) -> int:
    from ds_train.parity import run_jobs

    return run_jobs(args.plan)
