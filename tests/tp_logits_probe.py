"""Run under the deepspeed launcher by tests/test_checkpoint.py: the engine (AutoTP, AutoEP, LoRA) ds_train builds
for a run config, given a checkpoint tag's weights (DeepSpeed's load_checkpoint), and its logits on
a fixed input, which rank 0 writes: what an export of that tag must reproduce."""

import sys
from pathlib import Path

import torch

from ds_train import dist, topology
from ds_train.checkpoint import commit as checkpoint
from ds_train.config.file import load_config
from ds_train.inputs import check_inputs
from ds_train.start import build_run
from ds_train.train.loop import train_spec

config, ds_config, ckpt_dir, tag, out = [a for a in sys.argv[1:] if not a.startswith("--")]
cfg = load_config(config, [f"output_dir={Path(out).parent / 'probe_run'}", "checkpoint.resume=none"])
env = topology.detect_env()
inputs = check_inputs(cfg, ds_config)
with build_run(inputs, env, train_spec(cfg)) as run:
    run.engine.load_checkpoint(ckpt_dir, tag=tag, load_optimizer_states=False, load_lr_scheduler_states=False,
                               load_module_strict=not checkpoint.has_frozen(run.engine))  # LoRA: adapters only
    run.engine.eval()
    ids = torch.arange(2 * 24).reshape(2, 24) * 7 % len(inputs.source.tokenizer)
    with torch.no_grad():
        logits = run.engine(input_ids=ids.to(run.engine.device)).logits.float().cpu()
    if env.rank == 0:
        torch.save({"input_ids": ids, "logits": logits}, out)
dist.shutdown()
