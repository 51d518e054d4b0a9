"""ds-train: config-driven DeepSpeed training of Hugging Face causal LMs.

    deepspeed --num_gpus 2 --module ds_train train --config recipes/quickstart.yaml \
        --ds-config ds_configs/zero2.json train.max_steps=50
    torchrun --nproc_per_node 2 -m ds_train train --config ... --ds-config ...
    ds-train train --config ... --ds-config ...          # one process
    ds-train prepare SOURCE... --out DIR                 # tokenise text/JSONL into .bin files
    ds-train convert --to universal RUN_DIR              # DeepSpeed universal checkpoint
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ds_train.errors import UserError


def cmd_train(args) -> int:
    from ds_train.config import load_config
    from ds_train.trainer import train

    cfg = load_config(args.config, args.overrides)
    train(cfg, args.ds_config)
    return 0


def cmd_prepare(args) -> int:
    from ds_train.config import load_config
    from ds_train.data import load_meta, prepare

    if args.config:
        d = load_config(args.config, args.overrides).data
        sources, out, tok, vocab, val, key = d.sources, d.dir, d.tokenizer, d.vocab_size, d.val_fraction, d.text_key
    else:
        if not args.sources or not args.out:
            raise UserError("prepare: give SOURCE... --out DIR, or --config C (uses its data section)")
        if args.overrides:
            raise UserError("prepare: key=value overrides need --config")
        sources, out, tok, vocab, val, key = args.sources, args.out, args.tokenizer, args.vocab_size, \
            args.val_fraction, args.text_key
    prepare(sources, out, tok, vocab, val, key)
    meta = load_meta(out)
    print(f"wrote {out}/train.bin ({meta['train_tokens']:,} tokens), val.bin "
          f"({meta['val_tokens']:,} tokens), meta.json; vocab {meta['vocab_size']} ({meta['dtype']}); "
          f"tokenizer {meta['tokenizer']}")
    return 0


def cmd_convert(args) -> int:
    from pathlib import Path

    from ds_train.checkpoint import convert_to_universal, find_resume

    source = Path(args.source)
    ckpt_dir = source / "checkpoints" if (source / "checkpoints").is_dir() else source
    point = find_resume(args.tag or str(ckpt_dir), ckpt_dir)
    if point is None:
        raise UserError(f"convert: no checkpoint found in {str(source)!r}")
    out = convert_to_universal(point.load_dir / point.tag)
    print(f"wrote {out} (DeepSpeed universal checkpoint); resume from it at any world size with "
          f"checkpoint.resume={out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="show tracebacks and DeepSpeed's info logs")
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    t = sub.add_parser("train", help="train a causal LM (under deepspeed, torchrun or alone)",
                       description="Train. Overrides are dotted keys: train.max_steps=20 optim.lr=3e-4. "
                                   "--help-config lists every key.")
    t.add_argument("--config", help="run config YAML (recipes/*.yaml)")
    t.add_argument("--ds-config", help="DeepSpeed JSON (ds_configs/zero*.json)")
    t.add_argument("--help-config", action="store_true", help="list every config key and exit")
    t.add_argument("overrides", nargs="*", metavar="key=value")
    t.set_defaults(func=cmd_train)

    pr = sub.add_parser("prepare", help="tokenise text/JSONL files into train.bin / val.bin / meta.json")
    pr.add_argument("sources", nargs="*", metavar="SOURCE",
                    help="files or directories (.txt/.md/.py/... one document each, .jsonl one per "
                         "line), or python-stdlib")
    pr.add_argument("--out", help="output directory")
    pr.add_argument("--tokenizer", default="", help="tokenizer directory (default: train a byte-level BPE)")
    pr.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    pr.add_argument("--val-fraction", type=float, default=0.02, help="documents held out (default 0.02)")
    pr.add_argument("--text-key", default="text", help="JSONL text field (default text)")
    pr.add_argument("--config", help="take the data section of this run config instead")
    pr.add_argument("overrides", nargs="*", metavar="key=value", default=[])
    pr.set_defaults(func=cmd_prepare)
    c = sub.add_parser("convert", help="convert a checkpoint with DeepSpeed's ds_to_universal",
                       description="Convert a checkpoint (run dir, checkpoints dir or tag dir) into "
                                   "DeepSpeed's universal format, loadable at any world size and "
                                   "ZeRO stage. Resume does this by itself when they change.")
    c.add_argument("source", help="run directory, its checkpoints/ directory, or a tag directory")
    c.add_argument("--to", choices=["universal"], default="universal", help="target format")
    c.add_argument("--tag", help="tag to convert (default: the latest complete one)")
    c.set_defaults(func=cmd_convert)
    return p


def _split_overrides(args) -> None:
    """argparse puts SOURCE and key=value in one list for `prepare`; separate them."""
    if args.command == "prepare":
        args.overrides = [s for s in args.sources if "=" in s]
        args.sources = [s for s in args.sources if "=" not in s]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.debug:
        import warnings

        warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed deprecations
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "train":
        if args.help_config:
            from ds_train.config import describe

            print(describe())
            return 0
        if not args.config or not args.ds_config:
            parser.error("train needs --config and --ds-config")
    _split_overrides(args)
    try:
        return args.func(args)
    except UserError as e:
        if args.debug:
            raise
        from ds_train.dist import rank_for_messages

        rank = rank_for_messages()
        who = "ds-train" if rank == 0 else f"ds-train[rank {rank}]"
        print(f"{who}: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
