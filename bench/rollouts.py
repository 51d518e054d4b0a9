"""Batched rollouts against one episode at a time, side by side in one process.

    python bench/rollouts.py [--contexts 8] [--k 8] [--repeats 3]

The same policy (a small Llama, random weights: speed does not depend on what it learned), the
same jobs (every built-in task, `--contexts` contexts each, K rollouts per context); interleaved
repeats; prints episodes/s of both and the median ratio (target >= 5).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import cli  # noqa: E402


def build_policy(seed: int = 0):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ds_train.data.tokenizer import train_tokenizer
    from ds_train.ript.tasks import BUILTIN

    texts = [t().demonstration(c) for t in BUILTIN.values() for c in t().contexts("train", 200, seed)]
    tokenizer = train_tokenizer(texts, 300, Path(tempfile.mkdtemp(prefix="ript_tok_")))
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("llama", hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=4, vocab_size=len(tokenizer),
                               max_position_embeddings=256, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(cfg).eval(), tokenizer


def main() -> None:
    import torch

    from ds_train.ript.rollout import model_policy, rollout
    from ds_train.ript.tasks import BUILTIN

    ap = cli.ArgumentParser()
    ap.add_argument("--contexts", type=int, default=8, help="contexts per task")
    ap.add_argument("--k", type=int, default=8, help="rollouts per context")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, tokenizer = build_policy()
    jobs = [(t(), c, i) for t in BUILTIN.values() for c in t().contexts("train", args.contexts, 1)
            for i in range(args.k)]
    act = model_policy(model, tokenizer)
    rollout(act, tokenizer, jobs[:16], batch_size=16)  # warm-up
    batched, single = [], []
    for r in range(args.repeats):
        order = [("batched", len(jobs)), ("single", 1)] if r % 2 == 0 else [("single", 1), ("batched", len(jobs))]
        for name, bs in order:
            torch.manual_seed(r)
            t0 = time.perf_counter()
            eps = rollout(act, tokenizer, jobs, batch_size=bs)
            rate = len(eps) / (time.perf_counter() - t0)
            (batched if name == "batched" else single).append(rate)
            print(f"repeat {r} {name:>7}: {rate:8.1f} episodes/s ({len(eps)} episodes)", flush=True)
    ratio = statistics.median(b / s for b, s in zip(batched, single))
    print(f"batched / one-at-a-time episodes/s: {ratio:.1f}x (target >= 5x); "
          f"{len(jobs)} episodes = {len(BUILTIN)} tasks x {args.contexts} contexts x K {args.k}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
