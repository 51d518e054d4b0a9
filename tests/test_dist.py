"""ds_train.topology.detect_env: rank / world / master from recorded launcher environments (no process group)."""

from __future__ import annotations

import dataclasses

import pytest

from ds_train.topology import DistEnv, detect_env, first_slurm_host, threads_per_rank
from ds_train.errors import UserError

UNRELATED = {"PATH": "/usr/bin", "HOME": "/home/me", "OMP_NUM_THREADS": "4"}

# What `deepspeed --num_gpus 4` on node 0 of 1 gives rank 2 (deepspeed/launcher/launch.py).
DEEPSPEED = {**UNRELATED, "RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
             "MASTER_PORT": "29500", "CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": "4"}

# `torchrun --nnodes 2 --nproc-per-node 4`, rank 5 (node 1, local rank 1).
TORCHRUN = {**UNRELATED, "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1", "ROLE_RANK": "5", "MASTER_ADDR": "node-a", "MASTER_PORT": "29400",
            "TORCHELASTIC_RUN_ID": "job42", "TORCHELASTIC_RESTART_COUNT": "0"}

# `srun --nodes 4 --ntasks-per-node 2`, task 3 (second task on the second node).
SLURM = {**UNRELATED, "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
         "SLURM_NNODES": "4", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[003-005,009]",
         "SLURM_JOB_ID": "123456", "SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2(x4)"}


def test_deepspeed_launcher():
    env = detect_env(DEEPSPEED)
    assert env == DistEnv(rank=2, local_rank=2, world_size=4, local_world_size=4, node_rank=0,
                          master_addr="10.0.0.1", master_port=29500, launcher="deepspeed", nodes=1)
    assert not env.is_main


def test_deepspeed_launcher_multi_node_local_world_size():
    """Regression, fixed: before the fix, the deepspeed launcher exports the per-node process count as LOCAL_SIZE (it never
    sets LOCAL_WORLD_SIZE), but detect_env only reads LOCAL_WORLD_SIZE and falls back to WORLD_SIZE.
    On 2 nodes x 4 GPUs it reports local_world_size=8; dist.init then exports LOCAL_WORLD_SIZE=8.
    Expected: 4."""
    environ = {**DEEPSPEED, "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "CROSS_RANK": "1",
               "CROSS_SIZE": "2", "LOCAL_SIZE": "4"}
    env = detect_env(environ)
    assert (env.rank, env.local_rank, env.world_size, env.node_rank) == (5, 1, 8, 1)
    assert env.launcher == "deepspeed"
    assert env.local_world_size == 4


def test_deepspeed_launcher_rank_zero_is_main():
    env = detect_env({**DEEPSPEED, "RANK": "0", "LOCAL_RANK": "0"})
    assert env.is_main and env.rank == 0


def test_torchrun():
    env = detect_env(TORCHRUN)
    assert env == DistEnv(rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1,
                          master_addr="node-a", master_port=29400, launcher="torchrun")


def test_slurm_srun():
    env = detect_env(SLURM)
    assert env.launcher == "slurm"
    assert (env.rank, env.local_rank, env.world_size) == (3, 1, 8)
    assert env.local_world_size == 2
    assert env.node_rank == 1
    assert env.master_addr == "gpu003"
    assert env.master_port == 29500 + 123456 % 1000


def test_slurm_port_is_the_same_on_every_task():
    ports = {detect_env({**SLURM, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % 2),
                         "SLURM_NODEID": str(r // 2)}).master_port for r in range(8)}
    assert len(ports) == 1


def test_slurm_respects_an_exported_master():
    env = detect_env({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "31000"})
    assert (env.master_addr, env.master_port) == ("head", 31000)


def test_launcher_variables_win_over_slurm():
    env = detect_env({**SLURM, **DEEPSPEED})  # deepspeed launched inside an allocation
    assert env.launcher == "deepspeed" and env.rank == 2


def test_a_rank_and_world_the_submitting_shell_exported_into_an_srun_task_are_refused():
    """Inherited by every task of the step: each would take itself for rank 0 of 1 (one crashed, one trained
    alone). Consistent with SLURM's own numbers they are kept; torchrun's or deepspeed's win as before."""
    leaked = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": "47833"}
    with pytest.raises(UserError) as e:
        detect_env({**SLURM, **leaked})
    assert str(e.value).startswith("environment: RANK=0 and WORLD_SIZE=1 are set, but SLURM started this process as "
                                   "task 3 of 8 (SLURM_PROCID, SLURM_NTASKS)")
    assert "Unset RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE in the job script" in str(e.value)
    agreed = detect_env({**SLURM, **leaked, "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"})
    assert (agreed.rank, agreed.world_size, agreed.launcher) == (3, 8, "manual")


def test_manual_environment():
    env = detect_env({**UNRELATED, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": "29501", "LOCAL_RANK": "1", "NODE_RANK": "0"})
    assert env == DistEnv(1, 1, 2, 2, 0, "127.0.0.1", 29501, "manual")


def test_manual_environment_without_a_master_is_a_user_error():
    with pytest.raises(UserError, match="MASTER_ADDR or MASTER_PORT"):
        detect_env({"RANK": "0", "WORLD_SIZE": "2"})


def test_single_process():
    env = detect_env(UNRELATED)
    assert env == DistEnv(0, 0, 1, 1, 0, "127.0.0.1", 0, "single")
    assert env.is_main
    assert detect_env({}) == env


def test_dist_env_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        detect_env({}).rank = 3  # type: ignore[misc]


@pytest.mark.parametrize("bad", ["abc", "1.5", "-1", ""])
def test_non_integer_rank_is_a_user_error(bad):
    with pytest.raises(UserError) as e:
        detect_env({**DEEPSPEED, "RANK": bad})
    assert "RANK" in str(e.value) and repr(bad) in str(e.value)


@pytest.mark.parametrize("key", ["WORLD_SIZE", "MASTER_PORT", "CROSS_RANK"])
def test_other_non_integer_variables_are_user_errors(key):
    with pytest.raises(UserError, match=key):
        detect_env({**DEEPSPEED, key: "x"})


def test_non_integer_slurm_procid_is_a_user_error():
    with pytest.raises(UserError, match="SLURM_PROCID"):
        detect_env({**SLURM, "SLURM_PROCID": "three"})


def test_non_integer_local_rank_is_a_user_error():
    """Regression, fixed: before the fix, LOCAL_RANK (also LOCAL_WORLD_SIZE, NODE_RANK, SLURM_NNODES, SLURM_NODEID,
    SLURM_JOB_ID) is parsed with a bare int(), so LOCAL_RANK=abc raises ValueError with a traceback
    instead of a one-line UserError like RANK does. Expected: UserError naming LOCAL_RANK."""
    with pytest.raises(UserError, match="LOCAL_RANK"):
        detect_env({**DEEPSPEED, "LOCAL_RANK": "abc"})


@pytest.mark.parametrize("nodelist, first", [
    ("gpu[003-005,009]", "gpu003"),
    ("gpu[003-005,009],cpu1", "gpu003"),
    ("node7", "node7"),
    ("node7,node8", "node7"),
    ("node[12,3]", "node12"),
    ("node[1-4]", "node1"),
    ("rack1-node[07-09]", "rack1-node07"),
    ("a1.cluster.org", "a1.cluster.org"),
    ("login1,gpu[1-2]", "login1"),
    (" gpu[01-02] ", "gpu01"),
])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_slurm_without_a_node_list_uses_localhost():
    environ = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}
    assert detect_env(environ).master_addr == "localhost"
    assert detect_env({**environ, "SLURM_NODELIST": "n[5-6]"}).master_addr == "n5"


def test_the_ranks_of_a_node_split_its_cores_unless_omp_num_threads_is_set():
    assert threads_per_rank({}, 2, 2) == 1  # not 2 ranks x 2 threads on 2 cores
    assert threads_per_rank({}, 96, 8) == 12 and threads_per_rank({}, 7, 2) == 3
    assert threads_per_rank({}, 2, 4) == 1 and threads_per_rank({}, 16, 1) == 16
    assert threads_per_rank({"OMP_NUM_THREADS": "4"}, 2, 2) is None  # torch reads the user's own
    assert threads_per_rank({"OMP_NUM_THREADS": " "}, 8, 2) == 4


def _job(rank: int, world: int = 8, per_node: int = 4) -> DistEnv:
    return DistEnv(rank, rank % per_node, world, per_node, rank // per_node, "10.0.0.1", 29500, "deepspeed")


def test_a_job_splits_into_trainer_and_rollout_ranks_node_by_node():
    """ript.rollout_ranks_per_node=1 on 2 nodes of 4: each node's last local rank generates; each side a world of
    its own, its ranks numbered node by node; the device stays the rank's own local rank."""
    from ds_train.topology import split_job

    sides = [split_job(_job(r), 1) for r in range(8)]
    roles = [e.split.role for e in sides]
    assert roles == ["trainer"] * 3 + ["rollout"] + ["trainer"] * 3 + ["rollout"]
    assert [(e.rank, e.world_size, e.local_world_size) for e in sides if e.split.role == "trainer"] == [
        (0, 6, 3), (1, 6, 3), (2, 6, 3), (3, 6, 3), (4, 6, 3), (5, 6, 3)]
    assert [(e.rank, e.world_size, e.local_rank, e.node_rank) for e in sides if e.split.role == "rollout"] == [
        (0, 2, 0, 0), (1, 2, 0, 1)]
    split = sides[7].split
    assert split.job.rank == 7 and split.job.local_rank == 3  # the device: the launcher's local rank
    assert split.job_ranks("trainer") == [0, 1, 2, 4, 5, 6] and split.job_ranks("rollout") == [3, 7]
    assert [split.side_rank(r) for r in split.job_ranks("rollout")] == [0, 1]
    assert split.world("trainer").world_size == 6 and split.world("rollout").local_world_size == 1
    assert split_job(_job(5), 0) == _job(5)  # no split: the job as launched


def _deepspeed_env(world_info: dict[str, int], rank: int) -> dict[str, str]:
    """A rank's environment as deepspeed/launcher/launch.py writes it for `world_info` (host -> slots): ranks node by
    node in hostfile order, LOCAL_SIZE its own node's count, LOCAL_RANK = RANK % LOCAL_SIZE, CROSS_SIZE the nodes."""
    first = 0
    for node, (host, slots) in enumerate(world_info.items()):
        if rank < first + slots:
            return {"RANK": str(rank), "LOCAL_RANK": str(rank % slots), "WORLD_SIZE": str(sum(world_info.values())),
                    "LOCAL_SIZE": str(slots), "CROSS_RANK": str(node), "CROSS_SIZE": str(len(world_info)),
                    "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
        first += slots
    raise ValueError(rank)


@pytest.mark.parametrize("slots", [{"a": 2, "b": 4}, {"a": 4, "b": 2}, {"a": 3, "b": 3, "c": 2}, {"a": 1, "b": 3}])
def test_every_rank_of_an_uneven_deepspeed_launch_refuses_a_split_naming_its_node(slots):
    """Launched by plain `deepspeed --hostfile` on nodes of different slots (no preflight), no rank takes the split
    for one it can run: each says its node, its count and the job's, before anything waits on it."""
    from ds_train.topology import detect_env, split_job

    for rank in range(sum(slots.values())):
        env = detect_env(_deepspeed_env(slots, rank))
        with pytest.raises(UserError) as e:
            split_job(env, 1)
        assert f"node {env.node_rank} runs {env.local_world_size} of the job's {env.world_size} ranks over " \
               f"{len(slots)} nodes" in str(e.value), (rank, str(e.value))
    even = {"a": 3, "b": 3}
    assert [split_job(detect_env(_deepspeed_env(even, r)), 1).split.role for r in range(6)] == \
        ["trainer", "trainer", "rollout"] * 2


@pytest.mark.parametrize("env, n, needle", [
    (_job(0), 4, "each node runs 4 rank(s), and at least one must train; set it below 4"),
    (dataclasses.replace(_job(5), rank=2), 1, "numbered rank 2 (node 1, local rank 1) out of node order"),
    (_job(0, world=6), 1, "nodes run different numbers of ranks (6 in all, 4 here)"),
])
def test_a_job_that_cannot_split_is_one_line(env, n, needle):
    from ds_train.topology import split_job

    with pytest.raises(UserError, match="ript.rollout_ranks_per_node") as e:
        split_job(env, n)
    assert needle in str(e.value)
