"""Peak memory of the loss stage: the output head and cross-entropy over a micro-batch, forward and
backward, with the full logits against train.loss_tile_tokens' tiles (ds_train.train.losses.tiled_loss_sum).

    python bench/tiled_loss.py [--tokens 8192] [--vocab 32000] [--hidden 1024] [--tiles 4096 1024 256]

Each side runs in a fresh process (the peak resident set is a process's own): the hidden states
(requiring gradients) and the head's weight are made first, the process's peak RSS read, then one
forward and backward of the loss, and the peak read again; the difference is the loss stage's peak.
The losses and the gradient of the hidden states are compared with the full side's. CPU, fp32.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import cli  # noqa: E402


def side(tokens: int, vocab: int, hidden: int, tile: int) -> dict:
    import torch
    import torch.nn.functional as F

    from ds_train.train.losses import tiled_loss_sum

    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden) * hidden ** -0.5
    t = torch.randint(0, vocab, (tokens,))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if tile:
        loss = tiled_loss_sum(lambda x: F.linear(x, w), h, t, tile)
    else:
        loss = F.cross_entropy(F.linear(h, w).float(), t, reduction="sum")
    loss.backward()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"tile": tile, "loss": float(loss), "peak_bytes": after - before, "grad": h.grad[:4].flatten().tolist(),
            "grad_norm": float(h.grad.norm())}


def label(tile: int) -> str:
    return f"tiles of {tile}" if tile else "full logits"


def main(argv: list[str] | None = None) -> int:
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--tiles", type=int, nargs="+", default=[4096, 1024, 256])
    p.add_argument("--out", help="also write the results as JSON here")
    p.add_argument("--side", type=int, help=argparse.SUPPRESS)  # a worker: one side, JSON on stdout
    args = p.parse_args(argv)
    if args.side is not None:
        print(json.dumps(side(args.tokens, args.vocab, args.hidden, args.side)))
        return 0
    rows = []
    for tile in [0, *args.tiles]:
        out = subprocess.run([sys.executable, __file__, "--side", str(tile), "--tokens", str(args.tokens), "--vocab",
                              str(args.vocab), "--hidden", str(args.hidden)], capture_output=True, text=True)
        if out.returncode:
            log = cli.saved_output(out.stdout + out.stderr, f"side_{tile}")
            raise cli.fail(f"the {label(tile)} side failed (exit {out.returncode}); its output: {log}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    full = rows[0]
    print(f"loss stage, {args.tokens:,} tokens x vocab {args.vocab:,} (hidden {args.hidden}), fp32, CPU: peak RSS growth")
    for r in rows:
        r["ratio"] = full["peak_bytes"] / max(r["peak_bytes"], 1)
        r["loss_rel_diff"] = abs(r["loss"] - full["loss"]) / abs(full["loss"])
        r["grad_norm_rel_diff"] = abs(r["grad_norm"] - full["grad_norm"]) / full["grad_norm"]
        print(f"  {label(r['tile']):>14}: "
              f"{r['peak_bytes'] / 2**30:6.2f} GiB  ({r['ratio']:.1f}x lower)  loss rel diff {r['loss_rel_diff']:.1e}, "
              f"grad norm rel diff {r['grad_norm_rel_diff']:.1e}")
    if args.out:
        Path(args.out).write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                              "tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden,
                                              "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
