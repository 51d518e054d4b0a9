"""Run by tests/test_trainer.py under the deepspeed launcher (2 ranks): ranks hold different numbers
of tokens; writes each rank's token_mean and the single-process reference to OUT/rank_<r>.json."""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from ds_train import dist, topology
from ds_train.train.losses import forward_loss, token_mean

env = topology.detect_env()
dist.init(env)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(LlamaConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
    vocab_size=50, max_position_embeddings=64))
rng = np.random.default_rng(0)
batches = [rng.integers(0, 50, (1, 5)), rng.integers(0, 50, (3, 41))]  # rank 0: 4 targets, rank 1: 120
with torch.no_grad():
    parts = [forward_loss(model, b) for b in batches]
    loss_sum, tokens = parts[env.rank]
    got = token_mean(float(loss_sum), tokens)
    reference = sum(float(s) for s, _ in parts) / sum(n for _, n in parts)
    mean_of_means = sum(float(s) / n for s, n in parts) / len(parts)
Path(sys.argv[-1], f"rank_{env.rank}.json").write_text(json.dumps(
    {"tokens": tokens, "token_mean": got, "reference": reference, "mean_of_means": mean_of_means}))
dist.shutdown()
