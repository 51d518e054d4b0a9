"""Checkpoints and the run directory: a run directory's layout (rundir), where a run writes (storage),
DeepSpeed's partitioned checkpoints committed crash-safe (commit), DeepSpeed's universal checkpoint and
a save's weights made whole (universal), the checkpointer that decides when a step saves (checkpointer,
asyncsave), the resume every rank agrees on (consensus) and how it loads (resume), and a loadable
Hugging Face directory from a checkpoint (export, lora_export).

It may import the bottom (errors, fs, faults, dist, config), the plan, the model and the data packages;
nothing above it (no run, train, ript, observe or CLI module).
"""
