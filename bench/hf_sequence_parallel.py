"""The Hugging Face Trainer's own DeepSpeed sequence parallelism (Accelerate's ParallelismConfig,
sp_backend="deepspeed"): bench/long_context.py's comparison side. Launched like a ds_train run:

    deepspeed --num_gpus 2 bench/hf_sequence_parallel.py --config recipes/long_context.yaml \
        --seq-len 4096 --steps 6 --out FILE.json

The same model (model.config of the run config, sdpa attention), ZeRO stage 2, fp32, micro-batch 1,
one sequence per step over the 2 sequence ranks, on the run config's training tokens. Rank 0 writes
tokens/s: the median over the steps after the first, a step's time from one optimizer step's end
to the next (as ds_train's perf/tokens_per_s).

On the CPU accelerator two settings are needed (transformers 5.23, accelerate 1.15): not
`use_cpu=True` (TrainingArguments then skips DeepSpeed's process-group set-up, and Ulysses asserts
on it), and the process group built first with gloo (`PartialState(backend="gloo")`, reused with
`use_configured_state`: otherwise Accelerate finds no GPU backend and each rank believes it is
rank 0 of 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import cli  # noqa: E402


def main() -> int:
    p = cli.ArgumentParser()
    p.add_argument("--config", default=str(ROOT / "recipes" / "long_context.yaml"))
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--sequence", type=int, default=2)
    p.add_argument("--out")
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()

    import torch
    from accelerate import PartialState
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from torch.utils.data import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from ds_train.data.meta import META

    run = yaml.safe_load(Path(args.config).read_text())
    data_dir = ROOT / run["data"]["dir"]
    if not (data_dir / META).is_file():
        raise cli.fail(f"{data_dir} holds no prepared data ({META}): train {args.config} once, or `ds-train "
                       f"prepare --config {args.config}`, first")
    meta = json.loads((data_dir / META).read_text())
    tokens = np.memmap(data_dir / "train.bin", dtype=meta["dtype"], mode="r")
    seq = args.seq_len

    class Windows(Dataset):
        def __len__(self):
            return (len(tokens) - 1) // seq

        def __getitem__(self, i):
            ids = torch.from_numpy(tokens[i * seq:(i + 1) * seq].astype(np.int64))
            return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(seq)}

    model_cfg = {**run["model"]["config"], "max_position_embeddings": max(seq, 2048),
                 "vocab_size": meta["vocab_size"]}
    cfg = AutoConfig.for_model(**model_cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    ds_config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 2},
                 "bf16": {"enabled": False},
                 "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                           "weight_decay": "auto"}},
                 "zero_force_ds_cpu_optimizer": False}
    parallel = ParallelismConfig(sp_backend="deepspeed", sp_size=args.sequence, dp_replicate_size=1,
                                 sp_handler=DeepSpeedSequenceParallelConfig(
                                     sp_seq_length=seq, sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))
    out_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"ds_train_bench_hf_sp_{os.getppid()}"
    training = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=1, max_steps=args.steps,
                                 learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                                 deepspeed=ds_config, parallelism_config=parallel, ddp_backend="gloo",
                                 accelerator_config={"use_configured_state": True}, dataloader_num_workers=0,
                                 remove_unused_columns=False, disable_tqdm=True)

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.ends = [time.perf_counter()]

        def on_step_end(self, *_, **__):
            self.ends.append(time.perf_counter())

    times = StepTimes()
    trainer = Trainer(model=model, args=training, train_dataset=Windows(), callbacks=[times])
    trainer.train()
    steps = [b - a for a, b in zip(times.ends, times.ends[1:])]
    if int(os.environ.get("RANK", "0")) == 0:
        rate = seq / statistics.median(steps[1:])  # one sequence of seq tokens a step
        result = {"seq_len": seq, "steps": args.steps, "step_times_s": steps, "tokens_per_s": rate,
                  "sequence": args.sequence}
        print(f"hf trainer sequence parallel {args.sequence}: {rate:,.0f} tokens/s at seq_len {seq}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
