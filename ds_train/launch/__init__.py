"""Multi-node launch: hostfile parsing, preflight over ssh, `.deepspeed_env`, SLURM sbatch scripts.

    ds-train launch --hostfile hostfile -- train --config C --ds-config D
    ds-train launch --hostfile hostfile --check -- train --config C --ds-config D
    ds-train slurm --nodes 2 --gpus-per-node 8 --out job.sbatch -- train --config C --ds-config D
"""
