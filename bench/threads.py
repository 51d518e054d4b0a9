"""Ranks sharing a node's cores: torch's default threads in every rank (what the `deepspeed` launcher
leaves) against ds_train's split (ds_train.topology.threads_per_rank: the cores divided by the ranks).

    python bench/threads.py [--ranks N] [--repeats 2] [--forwards 10]

N processes (default: one per core, as `deepspeed --num_gpus N` starts on a CPU) run at once, each a
no-grad forward of the quickstart's model shape (hidden 128, 4 layers, vocabulary 4,096) on a
preference micro-batch (16 sequences of 127 tokens: the DPO reference pass), after one warm-up
forward. The sides take turns, `--repeats` times; each prints its mean milliseconds a forward
(the slowest rank's) and the ratio default / split.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import cli  # noqa: E402


def worker(threads: int, forwards: int) -> None:
    """One rank: `forwards` timed forwards with `threads` torch threads; prints ms a forward."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=4096,
                                         max_position_embeddings=256, tie_word_embeddings=True)).eval()
    ids = torch.randint(0, 4096, (16, 127))
    with torch.no_grad():
        model(input_ids=ids)
        start = time.perf_counter()
        for _ in range(forwards):
            model(input_ids=ids).logits.float().log_softmax(-1)
    print(f"{(time.perf_counter() - start) / forwards * 1000:.1f}")


def side(ranks: int, threads: int, forwards: int) -> float:
    """`ranks` workers at once; the slowest one's ms a forward."""
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(threads), str(forwards)],
                              stdout=subprocess.PIPE, text=True) for _ in range(ranks)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise cli.fail(f"a worker with {threads} threads failed")
    return max(float(out.split()[-1]) for out in outs)


def main() -> int:
    from ds_train.topology import threads_per_rank

    if sys.argv[1:2] == ["--worker"]:
        worker(int(sys.argv[2]), int(sys.argv[3]))
        return 0
    cores = len(os.sched_getaffinity(0))
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=cores, help="processes at once (default: one per core)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--forwards", type=int, default=10)
    args = ap.parse_args()
    if min(args.ranks, args.repeats, args.forwards) < 1:
        ap.error("--ranks, --repeats and --forwards must be at least 1")
    split = threads_per_rank({}, cores, args.ranks)
    print(f"{args.ranks} ranks on {cores} cores: torch's default {cores} threads a rank against {split}")
    for repeat in range(1, args.repeats + 1):
        default = side(args.ranks, cores, args.forwards)
        ours = side(args.ranks, split, args.forwards)
        print(f"repeat {repeat}: default {default:.0f} ms a forward, split {ours:.0f} ms; "
              f"default / split {default / ours:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
