"""Rollouts side by side in one process: batched against one episode at a time, or vLLM against batched.

    python bench/rollouts.py [--contexts 8] [--k 8] [--repeats 3]             # batched / one at a time
    python bench/rollouts.py --engine vllm [--out DIR]                         # vLLM / batched generate

The same policy (a small Llama, random weights: speed does not depend on what it learned; on a GPU in
bf16), the same jobs (every built-in task, `--contexts` contexts each, K rollouts per context), the same
sampling (temperature 1, the tasks' stop strings and token limits); interleaved repeats; prints the
episodes/s of both sides and the median ratio. `--engine vllm` samples through ds_train's vLLM engine
(ds_train/ript/vllm_engine.py, the weights synced from the model as a run syncs them) against the
Hugging Face path's batched generate; `--out` writes results.json there (the GPU lease's `rollouts`
part: bench/gpu/lease.py).
"""

from __future__ import annotations

import argparse
import json
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
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if torch.cuda.is_available():
        model = model.to("cuda", torch.bfloat16)
    return model, tokenizer


def sides(args, model, tokenizer, jobs) -> dict:
    """name -> (act, batch size) of the two sides compared."""
    from ds_train.ript.rollout import model_policy

    hf = model_policy(model, tokenizer, temperature=1.0)
    if args.engine == "batched":
        return {"batched": (hf, len(jobs)), "single": (hf, 1)}
    from ds_train.config.posttrain import RiptConfig
    from ds_train.ript.vllm_engine import INSTALL, VllmRollouts, installed_vllm

    if installed_vllm() is None:
        sys.exit(f"bench/rollouts.py --engine vllm: vLLM is not installed here; {INSTALL}")

    r = RiptConfig(rollout_contexts=len(jobs) // args.k, rloo_batch_size=args.k, rollout_engine="vllm")
    dtype = "bf16" if next(model.parameters()).is_cuda else "fp32"
    engine = VllmRollouts(model, tokenizer, r, dtype, seed=0, rank=0)
    return {"vllm": (engine.policy(1.0), len(jobs)), "batched": (hf, len(jobs))}


def main() -> None:
    import torch

    from ds_train.ript.rollout import rollout
    from ds_train.ript.tasks import BUILTIN

    ap = cli.ArgumentParser()
    ap.add_argument("--engine", choices=["batched", "vllm"], default="batched",
                    help="batched: batched generate against one episode at a time; vllm: vLLM against batched")
    ap.add_argument("--contexts", type=int, default=8, help="contexts per task")
    ap.add_argument("--k", type=int, default=8, help="rollouts per context")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="", help="write results.json here")
    ap.add_argument("--data", default="", help=argparse.SUPPRESS)  # the GPU lease's arguments to every part
    ap.add_argument("--timeout", default="", help=argparse.SUPPRESS)
    ap.add_argument("--reduced", action="store_true", help="1 context per task, 1 repeat")
    args = ap.parse_args()
    if args.reduced:
        args.contexts, args.repeats = 1, 1
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, tokenizer = build_policy()
    jobs = [(t(), c, i) for t in BUILTIN.values() for c in t().contexts("train", args.contexts, 1)
            for i in range(args.k)]
    acts = sides(args, model, tokenizer, jobs)
    for act, _ in acts.values():
        rollout(act, tokenizer, jobs[:16], batch_size=16)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in acts}
    for r in range(args.repeats):
        for name in (list(acts) if r % 2 == 0 else list(reversed(acts))):
            act, batch = acts[name]
            torch.manual_seed(r)
            t0 = time.perf_counter()
            eps = rollout(act, tokenizer, jobs, batch_size=batch)
            rates[name].append(len(eps) / (time.perf_counter() - t0))
            print(f"repeat {r} {name:>7}: {rates[name][-1]:8.1f} episodes/s ({len(eps)} episodes)", flush=True)
    first, second = acts
    ratio = statistics.median(a / b for a, b in zip(rates[first], rates[second]))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{first} / {second} episodes/s: {ratio:.1f}x ({device}); {len(jobs)} episodes = {len(BUILTIN)} tasks "
          f"x {args.contexts} contexts x K {args.k}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(
            {"engine": args.engine, "device": device, "episodes": len(jobs), "episodes_per_s": rates,
             "ratio": ratio, "ratio_of": f"{first} / {second}"}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(cli.run(main))
