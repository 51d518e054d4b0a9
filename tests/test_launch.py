"""ds_train.launch: hostfile parsing, .deepspeed_env, shell safety, the preflight (GPUs too), sbatch
scripts, the launch CLI.

Pure functions are tested directly; the CLI runs in a subprocess. Nothing here needs ssh (the real
two-node launch is in test_multinode.py).
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shlex
import socket
import stat
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ROOT, ds_train, tiny_config, write_config
from ds_train.config.file import describe, load_config
from ds_train.errors import UserError
from ds_train.launch import envfile
from ds_train.launch.hostfile import Host, is_valid_host, parse_hostfile, read_hostfile, select_hosts
from ds_train.launch.packages import OPTIONAL, local_versions, run_packages
from ds_train.launch.preflight import (HostProbe, SshOptions, check_gpus, check_identity, check_probes,
                                       check_shell_safe, compare_versions, node_ranks, one_machine_hosts,
                                       pick_master, run_preflight)
from ds_train.launch.probe import PROBE
from ds_train.launch.slurm import SlurmJob, render_sbatch

ZERO2 = str(ROOT / "ds_configs" / "zero2.json")


# --- hostfile -------------------------------------------------------------------------------------

def test_example_hostfile_is_valid():
    lines = (ROOT / "hostfile.example").read_text().splitlines()
    assert read_hostfile(ROOT / "hostfile.example") == [
        Host("node0", 8, lines.index("node0 slots=8") + 1), Host("node1", 8, lines.index("node1 slots=8") + 1)]


def test_comments_blank_lines_and_inline_comments():
    text = "# cluster\n\n   \nnode-a slots=4   # the fast one\n\t10.0.0.7\tslots=2\nnode_b.lab.example slots=1\n"
    assert parse_hostfile(text) == [Host("node-a", 4, 4), Host("10.0.0.7", 2, 5), Host("node_b.lab.example", 1, 6)]


@pytest.mark.parametrize("line, needle", [
    ("node1 slots=0", "slots=0 for 'node1' must be positive"),
    ("node1 slots=-2", "slots=-2 for 'node1' must be positive"),
    ("node1", "expected '<host> slots=<n>'"),
    ("node1 slots=", "expected '<host> slots=<n>'"),
    ("node1 slots=two", "expected '<host> slots=<n>'"),
    ("node1 slots=2 extra", "expected '<host> slots=<n>'"),
    ("node1 slots 2", "expected '<host> slots=<n>'"),
    ("node1;reboot slots=1", "'node1;reboot' is not a valid host name"),
    ("$(touch${IFS}/tmp/x) slots=1", "'$(touch${IFS}/tmp/x)' is not a valid host name"),
    ("`id` slots=1", "'`id`' is not a valid host name"),
    ("'node1' slots=1", "\"'node1'\" is not a valid host name"),
    ('"node1" slots=1', "'\"node1\"' is not a valid host name"),
    ("node1&&id slots=1", "is not a valid host name"),
    ("node|id slots=1", "is not a valid host name"),
    ("-oProxyCommand=id slots=1", "'-oProxyCommand=id' is not a valid host name"),
    ("node1 a slots=1", "expected '<host> slots=<n>', got 'node1 a slots=1'"),  # a space in the name
    ("node[1-4] slots=1", "is not a valid host name"),
    ("root@node1 slots=1", "is not a valid host name"),
])
def test_bad_lines_are_rejected_with_their_line_number(line, needle):
    with pytest.raises(UserError) as e:
        parse_hostfile(f"# header\nnode0 slots=1\n{line}\n", "hosts.txt")
    msg = str(e.value)
    assert msg.startswith("hosts.txt:3: "), msg
    assert needle in msg, msg
    assert "\n" not in msg and ";" in msg.split(": ", 2)[-1]  # one line: problem; fix


def test_duplicates_name_both_lines():
    with pytest.raises(UserError, match=r"^h:4: duplicate host 'node0' \(first on line 1\); list each host once"):
        parse_hostfile("node0 slots=1\nnode1 slots=1\n\nnode0 slots=2\n", "h")
    # DNS names are case-insensitive and may end in '.'; an address is one address however written
    for first, again in (("gpu-A.lab", "GPU-a.LAB."), ("fe80::1", "fe80:0:0::1"), ("Node_1", "node_1")):
        with pytest.raises(UserError) as e:
            parse_hostfile(f"{first} slots=1\nother slots=1\n{again} slots=2\n", "h")
        assert str(e.value) == (f"h:3: duplicate host {again!r} (first on line 1 as {first!r}); list each host "
                                f"once with its total slots (names are compared without case)")
    assert [h.name for h in parse_hostfile("node1 slots=1\nnode10 slots=1\n10.0.0.1 slots=1\n10.0.0.10 slots=1\n")] \
        == ["node1", "node10", "10.0.0.1", "10.0.0.10"]


def test_every_bad_line_is_reported_at_once():
    with pytest.raises(UserError) as e:
        parse_hostfile("a;b slots=1\nok slots=1\nok slots=1\nc slots=0\n", "h")
    lines = str(e.value).splitlines()
    assert lines[0] == "h: 3 bad lines:"
    assert [line.split(":")[1] for line in lines[1:]] == ["1", "3", "4"]


def test_empty_and_missing_hostfiles_are_errors(tmp_path):
    with pytest.raises(UserError, match="no hosts"):
        parse_hostfile("# nothing\n\n")
    with pytest.raises(UserError, match="hostfile not found"):
        read_hostfile(tmp_path / "nope")


@pytest.mark.parametrize("name, ok", [
    ("node0", True), ("gpu-001.cluster.example.org", True), ("10.1.2.3", True), ("fe80::1", True),
    ("ssh_alias", True), ("a" * 63, True), ("a" * 64, False), ("-node", False), ("node-", False),
    ("a..b", False), ("", False), ("node 1", False), ("node\t1", False), ("nøde", False),
    ("a;b", False), ("a$b", False), ("a`b`", False), ("a'b", False), ('a"b', False), ("a\\b", False),
    ("a>b", False), ("a*", False), ("~root", False),
])
def test_valid_host_names(name, ok):
    assert is_valid_host(name) is ok


def test_select_hosts_honours_the_launcher_filters():
    hosts = [Host("a", 4, 1), Host("b", 4, 2), Host("c", 2, 3)]
    world = lambda pool: sum(len(s) for s in pool.values())  # noqa: E731
    assert world(select_hosts(hosts)) == 10
    assert list(select_hosts(hosts, num_nodes=2)) == ["a", "b"]
    assert world(select_hosts(hosts, num_gpus=1)) == 3
    assert world(select_hosts(hosts, num_nodes=2, num_gpus=2)) == 4
    assert select_hosts(hosts, include="a:0,1@c") == {"a": [0, 1], "c": [0, 1]}
    assert world(select_hosts(hosts, exclude="b")) == 6
    with pytest.raises(UserError, match="cannot be combined"):
        select_hosts(hosts, num_gpus=1, include="a")
    with pytest.raises(UserError, match="--include/--exclude: .*'x'"):
        select_hosts(hosts, include="x")


UNEVEN = "node1 slots=4\nnode2 slots=2\nnode3 slots=4\n"


@pytest.mark.parametrize("flags", [{}, {"num_gpus": 2}, {"num_gpus": 4}, {"num_nodes": 2}, {"include": "node1:0,1@node2"},
                                   {"include": "node2@node3:1,2,3"}, {"exclude": "node1:3"}, {"exclude": "node2"}])
def test_each_nodes_ranks_are_read_as_the_deepspeed_launcher_starts_them(flags):
    """An uneven hostfile, with and without the launcher's filters: each node's ranks, the world size and the
    rank numbering are the ones DeepSpeed's own runner and launch compute (runner.parse_inclusion_exclusion,
    apply_num_nodes_and_gpus; launch.py numbers the ranks node by node, each node's own count its LOCAL_SIZE)."""
    from deepspeed.launcher.runner import apply_num_nodes_and_gpus, parse_inclusion_exclusion

    hosts = parse_hostfile(UNEVEN, "hf")
    theirs = apply_num_nodes_and_gpus(
        parse_inclusion_exclusion({h.name: h.slots for h in hosts}, flags.get("include", ""), flags.get("exclude", "")),
        flags.get("num_nodes", -1), flags.get("num_gpus", -1))
    nodes = node_ranks(select_hosts(hosts, **{"num_nodes": -1, "num_gpus": -1, **flags}), hosts, "hf")
    assert [(n.host, n.ranks) for n in nodes.nodes] == [(h, len(s)) for h, s in theirs.items()]
    assert nodes.world_size == sum(len(s) for s in theirs.values())
    assert nodes.per_node == math.gcd(*(len(s) for s in theirs.values()))  # what divides every node's ranks
    first = 0
    for n, line in zip(nodes.nodes, nodes.describe().split("), ")):
        assert line.startswith(f"{n.host}: {n.ranks} (rank") and f"{first}" in line
        first += n.ranks
    assert [n.where for n in nodes.nodes] == [f"hf:{h.line}" for h in hosts if h.name in theirs]
    assert nodes.even == (len({len(s) for s in theirs.values()}) == 1)


@pytest.mark.parametrize("flags, per_node, needles", [
    # node2 runs fewer ranks than the others: the split's two sides would not number node by node
    ({}, 1, ["ript.rollout_ranks_per_node=1: hf:2 (node2: slots=2, 2 ranks) runs fewer ranks than hf:1 (node1: "
                     "slots=4, 4 ranks) and hf:3 (node3: slots=4, 4 ranks)", "--num_gpus 2"]),
    # node2 would keep no trainer
    ({}, 2, ["ript.rollout_ranks_per_node=2: hf:2 (node2: slots=2, 2 ranks) runs no more ranks than that",
                     "--exclude node2", "below 2"]),
    ({"exclude": "node1:1,2,3"}, 1, ["hf:1 (node1: slots=4, 1 rank) runs no more ranks",
                                    "leave ript.rollout_ranks_per_node out"]),
    # even by --num_gpus, but every node too small: no node to leave out
    ({"num_gpus": 2}, 2, ["hf:1 (node1: slots=4, 2 ranks) and hf:2 (node2: slots=2, 2 ranks) and hf:3 "
                                  "(node3: slots=4, 2 ranks) run no more ranks than that", "start 3 or more"]),
])
def test_a_split_job_the_nodes_cannot_run_is_refused_in_one_line_before_any_ssh(tmp_path, flags, per_node, needles):
    hosts = parse_hostfile(UNEVEN, "hf")
    pool = select_hosts(hosts, **{"num_nodes": -1, "num_gpus": -1, **flags})

    def no_ssh(*args):
        raise AssertionError("probed the hosts")

    with pytest.raises(UserError) as e:
        run_preflight(pool, SshOptions(), sys.executable, str(tmp_path), "", 29500, probe=no_ssh,
                      nodes=node_ranks(pool, hosts, "hf"), rollout_per_node=per_node)
    line = str(e.value)
    assert "\n" not in line and line.startswith("preflight: ript.rollout_ranks_per_node="), line
    for needle in needles:
        assert needle in line, (needle, line)
    if "--exclude" in line:  # a node to leave out is named only where the nodes left can run the split
        left = select_hosts(hosts, exclude=line.split("--exclude ")[1].split(")")[0])
        assert not node_ranks(left, hosts).problems(per_node)
    assert ("--exclude" in line) == any(n.startswith("--exclude") for n in needles), line


def test_uneven_nodes_and_num_gpus_past_the_slots_are_said_node_by_node(tmp_path):
    """A job that is not split runs on uneven nodes (DeepSpeed allows it): the preflight says which node runs
    how many ranks, and --num_gpus starting more ranks than a node's slots=."""
    hosts = parse_hostfile(UNEVEN, "hf")
    cpu = lambda hosts_, *args: [_here(h, _cpu_probe) for h in hosts_]  # noqa: E731
    pool = select_hosts(hosts)
    result = run_preflight(pool, SshOptions(), sys.executable, str(tmp_path), "", 29500, probe=cpu,
                           nodes=node_ranks(pool, hosts, "hf"), rollout_per_node=0)
    assert result.world_size == 10
    assert result.notes[0] == ("the nodes run different numbers of ranks: node1: 4 (ranks 0-3), node2: 2 (ranks 4-5), "
                               "node3: 4 (ranks 6-9); the deepspeed launcher numbers them node by node and gives each "
                               "rank its own node's count (LOCAL_SIZE): a number that must divide every node's ranks "
                               "(ript.vllm_tensor_parallel_size) must divide 2, and a split job "
                               "(ript.rollout_ranks_per_node) cannot run")
    pool = select_hosts(hosts, num_gpus=3)
    result = run_preflight(pool, SshOptions(), sys.executable, str(tmp_path), "", 29500, probe=cpu,
                           nodes=node_ranks(pool, hosts, "hf"), rollout_per_node=1)
    assert result.world_size == 9 and result.notes[0] == (
        "--num_gpus 3 starts 3 ranks on hf:2 (node2: slots=2, 3 ranks) too (the deepspeed launcher gives every node "
        "--num_gpus ranks, whatever its slots=)")


# --- .deepspeed_env -------------------------------------------------------------------------------

ENVIRON = {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "DS_ACCELERATOR": "cuda",
           "WANDB_MODE": "offline", "WANDB_PROJECT": "proj", "HF_HOME": "/data/hf", "PYTHONPATH": "/opt/lib",
           "WANDB_API_KEY": "k-123", "HF_TOKEN": "hf_abc", "NCCL_SECRET_THING": "s", "MY_PASSWORD": "pw",
           "HOME": "/root", "PATH": "/usr/bin", "MY_FLAG": "1"}


def test_collect_env_forwards_the_job_variables_and_no_secrets():
    got = envfile.collect_env(ENVIRON, [], "/work")
    assert got == {"DS_ACCELERATOR": "cuda", "HF_HOME": "/data/hf", "NCCL_DEBUG": "INFO",
                   "NCCL_SOCKET_IFNAME": "eth0", "PYTHONPATH": "/work:/opt/lib", "WANDB_MODE": "offline",
                   "WANDB_PROJECT": "proj"}


def test_listed_variables_are_forwarded_secrets_included():
    got = envfile.collect_env(ENVIRON, ["MY_FLAG", "WANDB_API_KEY"], "/work")
    assert got["MY_FLAG"] == "1" and got["WANDB_API_KEY"] == "k-123"
    assert "HF_TOKEN" not in got and "MY_PASSWORD" not in got
    with pytest.raises(UserError, match="launch.env: NOT_SET not set in this environment"):
        envfile.collect_env(ENVIRON, ["NOT_SET"], "/work")


@pytest.mark.parametrize("name", ["WANDB_API_KEY", "HF_TOKEN", "GITHUB_TOKEN", "AWS_SECRET_ACCESS_KEY",
                                  "DB_PASSWORD", "OPENAI_API_KEY", "SSH_KEY", "NCCL_TOKEN_X"])
def test_secret_looking_names(name):
    assert envfile.looks_secret(name)


@pytest.mark.parametrize("name", ["NCCL_DEBUG", "HF_HOME", "WANDB_MODE", "PYTHONPATH", "KEYBOARD", "MONKEY"])
def test_ordinary_names(name):
    assert not envfile.looks_secret(name)


def test_env_file_has_no_blank_lines_and_reads_back_as_deepspeed_reads_it(tmp_path):
    variables = {"A": "1", "EMPTY": "", "SPACED": "a b c", "PATHS": "/x:/y", "EQ": "k=v=w"}
    path = envfile.write_env_file(tmp_path / "run" / ".deepspeed_env", variables)
    text = path.read_text()
    assert text.endswith("\n") and "\n\n" not in text and not text.startswith("\n")
    # deepspeed/launcher/runner.py: `for var in fd.readlines(): key, val = var.split('=', maxsplit=1)`
    read = dict(line.split("=", maxsplit=1) for line in open(path).readlines())
    assert {k: v.strip() for k, v in read.items()} == variables
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # listed variables may be credentials


def test_accepted_values_survive_the_launchers_quoting_through_a_real_shell():
    """What DeepSpeed's PDSHRunner.add_export makes of a value, run through bash: unchanged."""
    from deepspeed.launcher.multinode_runner import PDSHRunner

    runner = PDSHRunner(SimpleNamespace(user_args=[], user_script="x"), "")
    values = {"A": "plain", "B": "with spaces and 'single quotes'", "C": "a=b,c:d/e@f%g+h",
              "D": "semi;colon & amp | pipe < > ( ) * ? [ ] { } ~ # !"}
    envfile.check_values(values)
    for key, value in values.items():
        runner.add_export(key, value + "\n")  # as read from the file
    script = "".join(f"export {k}={v}; " for k, v in runner.exports.items())
    script += "; ".join(f'printf "%s\\0" "${k}"' for k in values)
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split("\0")[:-1] == list(values.values())


@pytest.mark.parametrize("value", ["$HOME", "a$(id)", "`id`", 'say "hi"', "back\\slash", "two\nlines",
                                   " leading", "trailing "])
def test_values_the_quoting_cannot_protect_are_refused_by_name(tmp_path, value):
    with pytest.raises(UserError) as e:
        envfile.write_env_file(tmp_path / ".deepspeed_env", {"GOOD": "1", "BAD_ONE": value})
    assert "BAD_ONE" in str(e.value) and "GOOD" not in str(e.value)
    assert not (tmp_path / ".deepspeed_env").exists()


def test_debug_network_and_allocator_variables_are_forwarded():
    environ = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128",
               "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
               "TORCH_NCCL_BLOCKING_WAIT": "1", "CUDA_LAUNCH_BLOCKING": "1", "GLOO_SOCKET_IFNAME": "eth0",
               "NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_SOCKET_IFNAME": "^docker0,lo",
               "TORCH_NCCL_TOKEN": "t", "TORCH_HOME": "/cache", "CUDA_VISIBLE_DEVICES": "0,1"}
    got = envfile.collect_env(environ, [], "/work")
    # Not the secret-looking name; not CUDA_VISIBLE_DEVICES, which the launcher sets per slot.
    assert got == {**{k: v for k, v in environ.items() if k not in ("TORCH_NCCL_TOKEN", "TORCH_HOME",
                                                                      "CUDA_VISIBLE_DEVICES")},
                   "PYTHONPATH": "/work"}
    envfile.render(got)  # the values pass the launcher's quoting
    with pytest.raises(UserError, match=r"cannot forward TORCH_DISTRIBUTED_DEBUG \(contains \['\$'\]\)"):
        envfile.render({**got, "TORCH_DISTRIBUTED_DEBUG": "$LEVEL"})


def test_launch_env_config_key():
    model = "model.config.model_type=llama"
    cfg = load_config(None, [model, "launch.env=[WANDB_API_KEY, MY_VAR]"])
    assert cfg.launch.env == ["WANDB_API_KEY", "MY_VAR"]
    with pytest.raises(UserError, match=r"override launch.env=\[A-B, 'x y'\]: 'A-B', 'x y' not a variable name"):
        load_config(None, [model, "launch.env=[A-B, 'x y']"])
    assert "launch.env = []" in describe()


# --- preflight (pure parts) -----------------------------------------------------------------------

def test_ssh_options_follow_pdsh_and_never_build_a_shell_string_from_a_host():
    ssh = SshOptions.from_env({"PDSH_SSH_ARGS_APPEND": "-F '/tmp/my dir/ssh_config' -o LogLevel=ERROR"}, 7,
                              ssh_port=2200)
    argv = ssh.argv("node1", ["/opt/py", "-c", "print('x y')", "/work dir"])
    assert argv[:5] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=7"]
    assert argv[5:11] == ["-F", "/tmp/my dir/ssh_config", "-o", "LogLevel=ERROR", "-p", "2200"]
    assert argv[11:13] == ["--", "node1"]
    assert shlex.split(argv[13]) == ["/opt/py", "-c", "print('x y')", "/work dir"]


def _probe(host, **info):
    base = {"python": "/venv/bin/python", "python_version": "3.11.7",
            "versions": {"ds_train": "0.1.0", "deepspeed": "0.19.8", "torch": "2.13.0"},
            "cwd_exists": True, "hostname": host, "addresses": ["10.0.0.1"], "free_port": None}
    return HostProbe(host, info={**base, **info})


def test_check_probes_reports_every_host_at_once():
    versions = {"ds_train": "0.1.0", "deepspeed": "0.19.8", "torch": "2.13.0"}
    probes = [_probe("a"), HostProbe("b", problem="b: not reachable by password-less ssh (refused)", unreachable=True),
              HostProbe("c", problem="c: no answer within 30 s over ssh", unreachable=True),
              _probe("d", versions={**versions, "torch": "2.4.0"}), _probe("e", cwd_exists=False),
              _probe("f", python="/other/python"), _probe("g", python_version="3.10.14"),
              _probe("h", versions={"ds_train": "0.1.0", "torch": "2.13.0"})]
    problems = check_probes(probes, "/venv/bin/python", "/work", versions, "3.11.7")
    assert "unreachable: b, c;" in problems[2]
    assert problems[3].startswith("f: Python /other/python differs from this machine's /venv/bin/python;")
    assert problems[4:7] == [
        "d: torch 2.4.0 (this machine: 2.13.0); install the same versions on every node (pip install torch==2.13.0 there)",
        "g: Python 3.10.14 (this machine: 3.11.7); use the same Python (3.11.7) and environment on every node",
        "h: deepspeed missing (this machine: 0.19.8); install the same versions on every node "
        "(pip install deepspeed==0.19.8 there)"]
    assert problems[7].startswith("e: working directory /work does not exist")
    assert len(problems) == 8 and not any(p.startswith("a:") for p in problems)


def test_two_names_of_one_machine_are_refused_naming_both_lines_unless_said_on_purpose(tmp_path):
    """An alias and an address of one machine (the hostfile parser cannot tell): the probes' boot id and host name."""
    boot = "0f3c2a1e-5d6b-4c7a-9e8f-112233445566"
    probes = [_probe("gpu-a", boot_id=boot, hostname="gpu-a"), _probe("10.0.0.5", boot_id=boot, hostname="gpu-a"),
              _probe("gpu-b", boot_id=boot.replace("0f", "aa"), hostname="gpu-b"),
              _probe("c1", boot_id="77", hostname="ctr-1"), _probe("c2", boot_id="77", hostname="ctr-2"),  # containers
              _probe("old"), HostProbe("gone", problem="gone: not reachable", unreachable=True)]
    where = {"gpu-a": "hf:1", "10.0.0.5": "hf:4"}
    problems, notes = check_identity(probes, where)
    assert problems == ["hf:1 (gpu-a) and hf:4 (10.0.0.5) are one machine (host gpu-a, boot id 0f3c2a1e): the launch "
                        "would start a set of ranks per name on its GPUs; list it once with its total slots (a test "
                        "cluster on one machine on purpose: DS_TRAIN_ONE_MACHINE=gpu-a,10.0.0.5)"] and notes == []
    allowed = one_machine_hosts({"DS_TRAIN_ONE_MACHINE": " gpu-a, 10.0.0.5 ,"})
    assert allowed == {"gpu-a", "10.0.0.5"} and one_machine_hosts({}) == set()
    assert check_identity(probes, where, allowed) == ([], ["gpu-a, 10.0.0.5 are one machine (gpu-a), as "
                                                           "DS_TRAIN_ONE_MACHINE says"])
    assert check_identity(probes, where, frozenset({"gpu-a", "gpu-b"}))[0] == problems  # both names, not one
    # through run_preflight: the problem beside the others, and the note of the allowed cluster
    here = [_here(h, _cpu_probe, boot_id=boot, hostname="vm") for h in ("127.0.0.2", "127.0.0.3")]
    with pytest.raises(UserError) as e:
        run_preflight(_slots(**{"127.0.0.2": 1, "127.0.0.3": 1}), SshOptions(), sys.executable, str(tmp_path), "",
                      29500, probe=lambda *args: here, where={"127.0.0.2": "h:1", "127.0.0.3": "h:2"})
    assert str(e.value).splitlines()[1].startswith("  h:1 (127.0.0.2) and h:2 (127.0.0.3) are one machine (host vm")
    result = run_preflight(_slots(**{"127.0.0.2": 1, "127.0.0.3": 1}), SshOptions(), sys.executable, str(tmp_path),
                           "", 29500, probe=lambda *args: here, one_machine=frozenset({"127.0.0.2", "127.0.0.3"}))
    assert result.notes[0] == "127.0.0.2, 127.0.0.3 are one machine (vm), as DS_TRAIN_ONE_MACHINE says"


def test_compare_versions_names_each_host_package_and_both_versions():
    here = {"Python": "3.11.7", "torch": "2.13.0", "transformers": "5.23.0", "wandb": None}
    hosts = {"n0": dict(here), "n1": {**here, "transformers": None}, "n2": {**here, "transformers": "5.22.0"},
             "n3": {**here, "transformers": None, "wandb": "0.31.0"}, "n4": {"Python": "3.11.7", "torch": "2.13.0"}}
    assert compare_versions(here, hosts) == [
        "n1, n3, n4: transformers missing (this machine: 5.23.0); install the same versions on every node "
        "(pip install transformers==5.23.0 there)",
        "n2: transformers 5.22.0 (this machine: 5.23.0); install the same versions on every node "
        "(pip install transformers==5.23.0 there)",
        "n3: wandb 0.31.0 (this machine: missing); install the same versions on every node (this machine has no "
        "wandb: pip uninstall wandb there)"]
    assert compare_versions(here, {"n0": here}) == [] and compare_versions(here, {}) == []
    assert compare_versions({"Python": "3.11.7"}, {"n0": {"Python": "3.12.1"}}) == [
        "n0: Python 3.12.1 (this machine: 3.11.7); use the same Python (3.11.7) and environment on every node"]


def test_the_packages_compared_are_ds_trains_dependencies_and_the_ones_the_config_turns_on():
    import importlib.metadata

    declared = {re.sub(r"[-_.]+", "-", re.match(r"[\w.-]+", r).group()).lower()
                for r in importlib.metadata.requires("ds_train") if "extra ==" not in r}  # an extra: not every run's
    plain = set(run_packages())
    assert {"ds-train", "torch", "deepspeed", "transformers", "tokenizers", "safetensors", "accelerate"} <= plain
    assert declared - set(OPTIONAL) <= plain and not set(OPTIONAL) & plain
    log = SimpleNamespace(wandb="online", tensorboard=False)
    assert set(run_packages(log)) - plain == {"wandb"}
    assert set(run_packages(SimpleNamespace(wandb="off", tensorboard=True))) - plain == {"tensorboard"}
    assert set(run_packages(load_config(str(ROOT / "recipes" / "quickstart.yaml")).log)) >= plain


def test_every_third_party_module_ds_train_imports_is_compared_across_hosts():
    """The derived list cannot fall behind the code: each top-level module imported anywhere in ds_train
    (`ds-train monitor` and `ds-train launch` aside: they run on the launching machine only) belongs to a
    distribution that preflight compares."""
    import ast
    import importlib.metadata

    everything = set(run_packages(SimpleNamespace(wandb="online", tensorboard=True),
                                  SimpleNamespace(rollout_engine="vllm"), SimpleNamespace(tasks=["arith_words"])))
    owners = importlib.metadata.packages_distributions()
    missing = {}
    for path in (ROOT / "ds_train").rglob("*.py"):
        if path.name == "monitor.py" or path.parent.name == "launch":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "ds_train" or top not in owners:
                    continue
                dists = {re.sub(r"[-_.]+", "-", d).lower() for d in owners[top]}
                if not dists & everything:
                    missing[top] = f"{path.relative_to(ROOT)} ({', '.join(sorted(dists))})"
    assert not missing, missing


def test_pick_master_takes_the_next_free_port_and_says_so():
    assert pick_master(_probe("10.0.0.5", free_port=29500), "", 29500) == ("10.0.0.5", 29500, [])
    addr, port, notes = pick_master(_probe("node0", free_port=29503), "", 29500)
    assert (addr, port) == ("10.0.0.1", 29503)  # a name: its first `hostname -I` address, as DeepSpeed does
    assert notes == ["master port 29500 is in use on node0; using 29503 instead"]
    assert pick_master(_probe("node0", free_port=29500), "head", 29500)[0] == "head"
    with pytest.raises(UserError, match="29500-29509 are all in use"):
        pick_master(_probe("node0", free_port=None), "", 29500)


def test_arguments_the_remote_shell_would_change_are_refused():
    assert check_shell_safe("/work/run", "/venv/bin/python",
                            ["train", "--config", "a.yaml", "optim.lr=1e-3", "log.sample_prompt=Once upon"]) == []
    problems = check_shell_safe("/work/my run", "/venv/bin/python",
                                ["train", "x=a;b", "log.sample_prompt=It's", "y=$HOME", "z=a b $HOME"])
    assert len(problems) == 5
    assert "working directory '/work/my run'" in problems[0]
    assert all(re.search(r"argument .*: the deepspeed launcher passes it", p) for p in problems[1:])


# --- preflight: GPUs ------------------------------------------------------------------------------

H100_MIB = 81559.0  # nvidia-smi's memory.total of an H100 80GB, in MiB


def _gpus(n, used_mib=None, driver="550.54.15"):
    """nvidia-smi's answer as the probe reports it; used_mib maps a GPU index to its used MiB."""
    return [{"index": i, "name": "NVIDIA H100 80GB HBM3", "memory_total_mib": H100_MIB,
             "memory_used_mib": (used_mib or {}).get(i, 4.0), "driver": driver} for i in range(n)]


def _gpu_probe(host, n=8, used_mib=None, driver="550.54.15", cuda="12.4", nccl="2.21.5", **info):
    return _probe(host, **{"gpus": _gpus(n, used_mib, driver), "gpu_error": None, "torch_cuda": cuda,
                           "torch_nccl": nccl, "torch_cuda_available": True, "torch_error": None, **info})


def _cpu_probe(host, **info):
    return _probe(host, **{"gpus": [], "gpu_error": None, "torch_cuda": None, "torch_nccl": None,
                           "torch_cuda_available": None, "torch_error": None, **info})


def _slots(**hosts):
    return {host: list(range(n)) for host, n in hosts.items()}


def test_fewer_gpus_than_slots_names_both_numbers_and_the_fixes():
    problems, _ = check_gpus([_gpu_probe("a"), _gpu_probe("b", n=4)], _slots(a=8, b=8))
    assert problems == ["b: 4 GPU(s) but the launch puts 8 process(es) there (its hostfile slots, --num_gpus or "
                        "--include); lower its slots= to 4 in the hostfile, or choose its GPUs with "
                        "--include b:0,1,2,3"]
    # --include a:4,5 on a host with slots=8 and four GPUs: few enough, but GPUs 4 and 5 do not exist.
    problems, _ = check_gpus([_gpu_probe("a", n=4)], {"a": [4, 5]})
    assert problems == ["a: slot(s) 4, 5 have no GPU (nvidia-smi lists GPUs 0, 1, 2, 3); choose existing GPUs "
                        "with --include a:0,1,2,3"]
    assert check_gpus([_gpu_probe("a", n=4)], {"a": [0, 2]})[0] == []


def test_too_little_free_memory_names_the_plan_the_gpu_and_who_holds_it():
    probes = [_gpu_probe("a", used_mib={3: 70000.0}), _gpu_probe("b", used_mib={7: 60000.0})]
    pool = {"a": list(range(8)), "b": list(range(7))}  # b's GPU 7 is not used (--include b:0,...,6)
    problems, _ = check_gpus(probes, pool, needed_gib=30.0)
    assert problems == ["a: the memory plan needs 30.0 GiB per GPU; GPU 3 on a has 11.3 GiB free (another "
                        "process holds 68.4 GiB: nvidia-smi); stop that process or leave the GPU out "
                        "(--exclude a:3)"]
    # A plan bigger than the empty GPU: no other process to blame, every GPU named.
    problems, _ = check_gpus([_gpu_probe("a", n=2)], _slots(a=2), needed_gib=90.0)
    assert problems == [f"a: the memory plan needs 90.0 GiB per GPU; GPU {i} on a has 79.6 GiB free (79.6 GiB in "
                        f"all); lower the per-GPU memory (`ds-train estimate` ranks the changes) or use larger GPUs"
                        for i in (0, 1)]
    assert check_gpus(probes, pool, needed_gib=None)[0] == []  # no plan given: no memory check
    assert check_gpus(probes, pool, needed_gib=11.0)[0] == []
    # nvidia-smi's [N/A] (read as None) is no number to compare
    na = _gpu_probe("a", n=1)
    na.info["gpus"][0]["memory_used_mib"] = None
    assert check_gpus([na], _slots(a=1), needed_gib=100.0)[0] == []


def test_driver_cuda_and_nccl_must_match_across_hosts():
    probes = [_gpu_probe("a"), _gpu_probe("b", driver="535.104.05"), _gpu_probe("c", cuda="12.1", nccl="2.18.1")]
    problems, _ = check_gpus(probes, _slots(a=8, b=8, c=8))
    assert problems == [
        "NVIDIA driver differs between hosts: 550.54.15 on a, c; 535.104.05 on b; use the same driver and image "
        "(torch build) on every node",
        "CUDA runtime (torch.version.cuda) differs between hosts: 12.4 on a, b; 12.1 on c; use the same driver "
        "and image (torch build) on every node",
        "NCCL (torch.cuda.nccl.version()) differs between hosts: 2.21.5 on a, b; 2.18.1 on c; use the same "
        "driver and image (torch build) on every node"]


def test_hosts_with_and_without_gpus_are_refused():
    problems, notes = check_gpus([_gpu_probe("a"), _cpu_probe("b"), _gpu_probe("c"), _cpu_probe("d")],
                                 _slots(a=8, b=8, c=8, d=8))
    assert problems == ["GPUs on a, c but none on b, d (no nvidia-smi there, or it lists no GPU); one job runs on "
                        "one kind of accelerator: leave those hosts out (--exclude b@d) or install the NVIDIA "
                        "driver there"]
    assert notes == []


def test_cpu_only_hosts_are_a_note_not_a_problem():
    probes = [_cpu_probe("a"), _cpu_probe("b")]
    assert check_gpus(probes, _slots(a=2, b=2), needed_gib=30.0) == (
        [], ["no GPUs on any host: DeepSpeed's CPU accelerator runs 2 processes per node"])
    assert check_gpus(probes, _slots(a=2, b=1))[1] == [
        "no GPUs on any host: DeepSpeed's CPU accelerator runs one process per slot (a: 2, b: 1)"]
    assert check_gpus([_cpu_probe("a")], _slots(a=1))[1] == [
        "no GPUs on any host: DeepSpeed's CPU accelerator runs 1 process per node"]


def test_a_broken_driver_or_cuda_install_is_a_problem_of_its_host():
    probes = [_gpu_probe("a", torch_error="RuntimeError: CUDA driver initialization failed"),
              _gpu_probe("b", torch_cuda_available=False),
              _gpu_probe("c", cuda=None, nccl=None),
              _cpu_probe("d", gpu_error="nvidia-smi failed (exit 9: NVIDIA-SMI has failed because it couldn't "
                                        "communicate with the NVIDIA driver.)")]
    problems, _ = check_gpus(probes, _slots(a=8, b=8, c=8, d=8))
    assert problems[0].startswith("d: nvidia-smi failed (exit 9: NVIDIA-SMI has failed") and \
        problems[0].endswith("fix the NVIDIA driver there (`nvidia-smi` must list the GPUs) or leave the host out "
                             "(--exclude d)")
    assert problems[1] == ("a: torch cannot use the GPUs there (RuntimeError: CUDA driver initialization failed); "
                           "every rank would fail the same way: install a driver that supports torch's CUDA 12.4, "
                           "or the torch build that matches the driver")
    assert problems[2].startswith("b: nvidia-smi lists 8 GPU(s) but torch.cuda.is_available() is False there")
    assert problems[3] == ("c: nvidia-smi lists 8 GPU(s) but torch there is a CPU-only build (torch.version.cuda "
                           "is None); install a CUDA build of torch on every node")
    assert any(p.startswith("CUDA runtime (torch.version.cuda) differs between hosts") for p in problems[4:])
    assert not any(p.startswith("GPUs on") for p in problems)  # d's broken nvidia-smi is not "a host without GPUs"


def _here(host, probe, **info):
    """A probe answer that matches this machine (python, versions), so only the GPU checks speak."""
    return probe(host, python=sys.executable, python_version=platform.python_version(),
                 versions=local_versions(run_packages()), free_port=29500, **info)


def test_run_preflight_reports_every_problem_at_once_and_notes_the_gpus(tmp_path):
    ssh = SshOptions()
    probes = [_here("a", _gpu_probe, used_mib={1: 70000.0}), _here("b", _gpu_probe, n=4, driver="535.104.05"),
              _here("c", _cpu_probe), _here("d", _gpu_probe, cwd_exists=False)]
    asked = []

    def fake_probe(hosts, ssh_, python, cwd, port, packages):
        asked.append((hosts, python, cwd, port, packages))
        return probes

    pool = _slots(a=8, b=8, c=8, d=8)
    with pytest.raises(UserError) as e:
        run_preflight(pool, ssh, sys.executable, str(tmp_path), "", 29500, needed_gib=30.0, probe=fake_probe)
    assert asked == [(["a", "b", "c", "d"], sys.executable, str(tmp_path), 29500, run_packages())]
    lines = str(e.value).splitlines()
    assert lines[0] == "preflight: 5 problems:"
    assert [line.strip().split(" ")[0] for line in lines[1:]] == ["d:", "a:", "b:", "GPUs", "NVIDIA"]
    assert "a: the memory plan needs 30.0 GiB per GPU; GPU 1 on a has 11.3 GiB free" in lines[2]
    assert "b: 4 GPU(s) but the launch puts 8 process(es) there" in lines[3]

    ok = [_here("a", _gpu_probe), _here("b", _gpu_probe)]
    result = run_preflight(_slots(a=8, b=8), ssh, sys.executable, str(tmp_path), "", 29500, needed_gib=30.0,
                           probe=lambda *args: ok)
    assert (result.master_addr, result.master_port, result.world_size) == ("10.0.0.1", 29500, 16)
    assert result.notes == ["GPUs: 8 x NVIDIA H100 80GB HBM3 on a, b (driver 550.54.15, CUDA 12.4, NCCL 2.21.5); "
                            "the memory plan needs 30.0 GiB per GPU, the least free is 79.6 GiB"]
    cpu = [_here("a", _cpu_probe), _here("b", _cpu_probe)]
    result = run_preflight(_slots(a=2, b=2), ssh, sys.executable, str(tmp_path), "", 29500, needed_gib=30.0,
                           probe=lambda *args: cpu)
    assert result.notes == ["no GPUs on any host: DeepSpeed's CPU accelerator runs 2 processes per node"]


def _run_probe(cwd, env=None, packages=()):
    """PROBE as probe_host runs it on a host (`python -c PROBE cwd port package...`), here without ssh."""
    proc = subprocess.run([sys.executable, "-c", PROBE, str(cwd), "0", *packages], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_probe_runs_here_and_reports_no_gpus_and_torchs_cuda_build(tmp_path):
    import torch

    # PATH without nvidia-smi (and without `hostname`): a CPU host, whatever this machine has.
    info = _run_probe(tmp_path, env={"PATH": str(tmp_path)}, packages=("transformers", "Huggingface_Hub", "no-such-pkg"))
    assert info["python"] == sys.executable and info["cwd_exists"] is True and info["free_port"] is None
    assert info["python_version"] == platform.python_version()
    assert info["versions"] == {"transformers": local_versions(("transformers",))["transformers"],
                                "Huggingface_Hub": local_versions(("huggingface-hub",))["huggingface-hub"],
                                "no-such-pkg": None}
    assert None not in list(info["versions"].values())[:2]
    assert info["gpus"] == [] and info["gpu_error"] is None
    assert info["boot_id"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()  # this machine's identity
    assert info["hostname"] == socket.gethostname()
    assert info["torch_cuda"] == torch.version.cuda  # None on a CPU build of torch
    assert "torch_nccl" in info and (info["torch_nccl"] is None) == (torch.version.cuda is None)
    assert info["torch_cuda_available"] is None and info["torch_error"] is None  # not asked: nothing listed
    assert check_gpus([HostProbe("here", info=info)], _slots(here=2)) == (
        [], ["no GPUs on any host: DeepSpeed's CPU accelerator runs 2 processes per node"])


@pytest.mark.parametrize("script, gpus, error", [
    ('printf "0, NVIDIA H100 80GB HBM3, 81559, 4, 550.54.15\\n1, NVIDIA A100-SXM4-80GB, 81920, [N/A], '
     '550.54.15\\n"',
     [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559.0, "memory_used_mib": 4.0,
       "driver": "550.54.15"},
      {"index": 1, "name": "NVIDIA A100-SXM4-80GB", "memory_total_mib": 81920.0, "memory_used_mib": None,
       "driver": "550.54.15"}], None),
    ('echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9', [],
     "nvidia-smi failed (exit 9: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.)"),
    ('echo "No devices were found"; exit 6', [], None),
])
def test_the_probe_reads_nvidia_smi(tmp_path, script, gpus, error):
    """A stand-in nvidia-smi on PATH: the probe's query and how it reads the answer."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(f"#!/bin/sh\n"
                                     f'[ "$*" = "--query-gpu=index,name,memory.total,memory.used,driver_version '
                                     f'--format=csv,noheader,nounits" ] || exit 2\n{script}\n')
    (fake / "nvidia-smi").chmod(0o755)
    info = _run_probe(tmp_path, env={"PATH": f"{fake}:/usr/bin:/bin"})
    assert (info["gpus"], info["gpu_error"]) == (gpus, error)


# --- SLURM ----------------------------------------------------------------------------------------

def test_sbatch_script_has_the_resources_quotes_user_values_and_passes_bash_n(tmp_path):
    job = SlurmJob(nodes=4, gpus_per_node=8, partition="gpu", time="24:00:00", job_name="my job $(id)",
                   account="proj-1", requeue=True, signal_lead_s=240)
    script = render_sbatch(job, "/venv/bin/python", "/work/ds train", ["--cpus-per-task", "6"],
                           ["train", "--config", "recipes/a b.yaml", "--ds-config", "ds_configs/zero3.json"])
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directives == ["#SBATCH --job-name='my job $(id)'", "#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8",
                          "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu", "#SBATCH --time=24:00:00",
                          "#SBATCH --account=proj-1", "#SBATCH --signal=USR1@240", "#SBATCH --open-mode=append",
                          "#SBATCH --requeue"]
    assert "cd '/work/ds train'" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert shlex.split(srun) == ["srun", "--wait=60", "--cpus-per-task", "6", "/venv/bin/python", "-u",
                                 "-m", "ds_train", "train", "--config", "recipes/a b.yaml", "--ds-config",
                                 "ds_configs/zero3.json"]
    assert 'if [ "$code" -eq 138 ]; then' in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    lines = script.splitlines()  # the ranks number themselves from SLURM, whatever the submitting shell exported
    assert lines.index("unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE") < lines.index(srun)


def test_sbatch_without_optional_resources():
    script = render_sbatch(SlurmJob(2, 1, signal_lead_s=0, request_gpus=False), "/py", "/w", [],
                           ["train", "--config", "c", "--ds-config", "d"])
    for absent in ("--partition", "--requeue", "--account", "--signal=", "--gpus-per-node", "scontrol"):
        assert absent not in script
    with pytest.raises(UserError, match="--nodes 0 must be positive"):
        render_sbatch(SlurmJob(0, 1), "/py", "/w", [], [])


@pytest.mark.parametrize("code, requeued", [(138, True), (143, False), (0, False), (1, False)])
def test_the_script_requeues_only_after_the_save_before_the_time_limit(tmp_path, code, requeued):
    """The script's tail, run by bash with srun and scontrol standing in as recorders."""
    script = render_sbatch(SlurmJob(1, 2, requeue=True), "/py", "/w", [], ["train"])
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(f"#!/bin/sh\nexit {code}\n")
    (fake / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/scontrol.log\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n1"}
    proc = subprocess.run(["bash", "-c", script.replace("cd /w", "true")], env=env, capture_output=True, text=True)
    assert proc.returncode == code
    log = tmp_path / "scontrol.log"
    assert (log.read_text() == "requeue 42\n") if requeued else not log.exists()


# --- CLI ------------------------------------------------------------------------------------------

@pytest.fixture
def run_config(tiny_data, tmp_path):
    return write_config(tmp_path / "run.yaml", tiny_config(tiny_data, tmp_path / "run"))


def test_slurm_cli_writes_the_script_and_checks_the_batch_math(run_config, tmp_path, capsys):
    from ds_train.__main__ import main

    out = tmp_path / "job.sbatch"
    args = ["slurm", "--nodes", "2", "--gpus-per-node", "2", "--partition", "debug", "--requeue", "--out", str(out),
            "--", "train", "--config", str(run_config), "--ds-config", ZERO2, "train.max_steps=3"]
    res = ds_train(*args, timeout=60)
    assert res.returncode == 0, res.out
    last = res.out.strip().splitlines()[-1]
    assert last == f"slurm: wrote {out} (2 node(s) x 2 rank(s)); submit it with: sbatch {out}", res.out
    assert main([a for a in args if a not in ("--out", str(out))]) == 0  # the script alone on stdout
    said = capsys.readouterr()
    assert said.out == out.read_text()
    assert said.err.splitlines()[-1] == ("slurm: wrote the sbatch script (2 node(s) x 2 rank(s)) to stdout; submit it "
                                         "with sbatch")
    subprocess.run(["bash", "-n", str(out)], check=True)
    assert "#SBATCH --nodes=2" in out.read_text() and "train.max_steps=3" in out.read_text()
    assert "#SBATCH --ntasks-per-node=2" in out.read_text() and "#SBATCH --signal=USR1@300" in out.read_text()
    res = ds_train("slurm", "--nodes", "3", "--gpus-per-node", "1", "--", "train", "--config", str(run_config),
                   "--ds-config", ZERO2, timeout=60)
    assert res.returncode == 2
    assert "train.global_batch_size=8 is not a multiple of train.micro_batch_size=2 x world size 3" in res.out


def test_slurm_cli_takes_ript_checked_by_its_own_parser_and_batch_math(tiny_policy, tmp_path):
    """Any command that runs on every rank goes after `--`: ript's script is written, ript's own
    arguments and its rollout batch math are checked for the target world size first."""
    from conftest import TESTS_ON_PATH, ript_config

    cfg = ript_config(tmp_path, tiny_policy)  # 3 contexts x K 4 = 12 rollouts per rank; global 24
    out = tmp_path / "ript.sbatch"
    res = ds_train("slurm", "--nodes", "2", "--gpus-per-node", "1", "--out", str(out), "--", "ript", "--config",
                   str(cfg), "--ds-config", ZERO2, "ript.iterations=5", timeout=60, env=TESTS_ON_PATH)
    assert res.returncode == 0, res.out
    subprocess.run(["bash", "-n", str(out)], check=True)
    srun = next(line for line in out.read_text().splitlines() if line.startswith("srun "))
    assert shlex.split(srun)[-6:] == ["ript", "--config", str(cfg), "--ds-config", ZERO2, "ript.iterations=5"]
    res = ds_train("slurm", "--nodes", "3", "--gpus-per-node", "1", "--", "ript", "--config", str(cfg),
                   "--ds-config", ZERO2, timeout=60)
    assert res.returncode == 2 and "12 rollouts per rank must be a multiple of" in res.out, res.out
    res = ds_train("slurm", "--nodes", "2", "--gpus-per-node", "1", "--", "ript", "--config", str(cfg),
                   "--ds-config", ZERO2, "--bogus", timeout=60)
    assert res.returncode == 2 and "unrecognized arguments: --bogus" in res.out, res.out


def test_malicious_host_name_is_never_executed(run_config, tmp_path):
    marker = Path(f"/tmp/pwned_{uuid.uuid4().hex}")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"127.0.0.1 slots=1\n"
                        f"x;touch${{IFS}}{marker} slots=1\n"
                        f"$(touch${{IFS}}{marker}) slots=1\n"
                        f"`touch${{IFS}}{marker}` slots=1\n")
    res = ds_train("launch", "--hostfile", str(hostfile), "--check", "--", "train", "--config", str(run_config),
                   "--ds-config", ZERO2, timeout=60)
    assert res.returncode == 2, res.out
    for line in (2, 3, 4):
        assert f"{hostfile}:{line}: " in res.out
    assert "Traceback" not in res.out
    assert not marker.exists()


def test_the_launchers_last_line_says_how_the_job_ended(tmp_path):
    """`ds-train launch` ends with one line after the launchers' own: done, the report a rank wrote,
    a signal's stop, or the exit code (with what it means where the ranks said why)."""
    from ds_train.launch.cli import final_line

    run = tmp_path / "run"
    logs = f"each rank's output is in {run / 'logs'}/rank_<r>.log on its node"
    assert final_line(run, 0, 0.0) == f"launch: done, every rank exited 0; run directory {run.resolve()}"
    assert final_line(run, 1, 0.0) == f"ds-train: error: the job ended with exit code 1; {logs}"
    assert final_line(run, 2, 0.0) == ("ds-train: error: the job ended with exit code 2: bad input, named in the "
                                       "error line above")
    assert final_line(run, 3, 0.0) == ("ds-train: error: the job ended with exit code 3: too many non-finite steps "
                                       f"(train.nonfinite=stop), said in the ranks' error line above; {logs}")
    assert final_line(run, 143, 0.0) == "ds-train: stopped by signal 15; no checkpoint was saved by this job"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "failure.json").write_text(json.dumps({"line": "rank 1 on node 1 (b) failed first"}))
    assert final_line(run, 1, 0.0) == "ds-train: error: rank 1 on node 1 (b) failed first"


def test_the_verdict_stays_last_when_the_store_stops_answering_mid_beat(capfd, tmp_path):
    """The job ends while `ds-train launch`'s beat is connecting to a store that accepted the connection
    but no longer answers (rank 0 killed just then): torch's client logs its timeout on stderr. That
    line comes before the verdict, never after it: the last line still says how the job ended."""
    import socket
    import threading
    import time

    from ds_train.launch.cli import supervise

    store = socket.socket()  # accepts (the kernel's backlog), never answers, and goes as the job ends
    store.bind(("127.0.0.1", 0))
    store.listen(8)
    threading.Timer(0.5, store.close).start()
    started = time.monotonic()
    code = supervise([sys.executable, "-c", "import time; time.sleep(0.5); exit(1)"], dict(os.environ),
                     "127.0.0.1", store.getsockname()[1], tmp_path / "run", beat_s=1)
    time.sleep(max(0.0, started + 5 - time.monotonic()))  # past the beat's connect and its retries (~4.5 s)
    lines = capfd.readouterr().err.strip().splitlines()  # the verdict of a failed job and torch's log: stderr
    assert code == 1
    assert lines[-1] == ("ds-train: error: the job ended with exit code 1; each rank's output is in "
                         f"{tmp_path / 'run' / 'logs'}/rank_<r>.log on its node"), lines[-3:]


def test_launch_errors_before_any_ssh(run_config, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=3\n")
    base = ["--", "train", "--config", str(run_config), "--ds-config", ZERO2]
    cases = [
        (["--hostfile", str(tmp_path / "nope")] + base, "hostfile not found"),
        (["--hostfile", str(hostfile)] + base, "not a multiple of train.micro_batch_size=2 x world size 3"),
        (["--hostfile", str(hostfile), "--num_gpus", "2"] + base[:-2] + ["--ds-config", str(tmp_path / "x.json")],
         "not found"),
        (["--hostfile", str(hostfile), "--launcher", "openmpi"] + base, "--launcher openmpi is not supported"),
        (["--hostfile", str(hostfile), "--module"] + base, "--module not supported here"),
        (["--hostfile", str(hostfile)], "missing `-- train"),
        (["--hostfile", str(hostfile), "--", "prepare", "x"], "after `--` comes the command every rank runs, train or ript; got 'prepare'"),
        (["--hostfile", str(hostfile), "--"], "nothing after `--`"),
        (["--hostfile", str(hostfile), "--num_gpus", "2"] + base + ["log.sample_prompt=a;b"],
         "argument 'log.sample_prompt=a;b'"),
    ]
    for argv, needle in cases:
        res = ds_train("launch", *argv, timeout=60)
        assert res.returncode == 2 and needle in res.out, (argv, res.out)
        assert "Traceback" not in res.out
    res = ds_train("launch", "--hostfile", str(hostfile), "--num_gpus", "2", *base, timeout=60,
                   env={"NCCL_BAD": "$(id)"})
    assert res.returncode == 2 and "NCCL_BAD" in res.out, res.out
    assert not (tmp_path / "run").exists()  # nothing written by a failed launch


def test_a_split_job_on_an_uneven_hostfile_is_refused_naming_the_node_before_any_ssh(tiny_policy, tmp_path):
    """`launch --check -- ript` with rollout ranks: node2 (2 slots) beside node1 (4) is named in one line, before the
    command's own checks split the job at one count a node (they said `each node runs 2 rank(s)`)."""
    from conftest import expect_error, ript_config

    cfg = ript_config(tmp_path, tiny_policy, train={"global_batch_size": 12})
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.2 slots=4\n127.0.0.3 slots=2\n")
    for n, said in ((1, "runs fewer ranks than"), (2, "runs no more ranks than that")):
        expect_error(["launch", "--hostfile", str(hostfile), "--check", "--", "ript", "--config", str(cfg),
                      "--ds-config", ZERO2, f"ript.rollout_ranks_per_node={n}"],
                     f"preflight: ript.rollout_ranks_per_node={n}: {hostfile}:2 (127.0.0.3: slots=2, 2 ranks) {said}")
    assert not (tmp_path / "run").exists()


def test_launch_help():
    res = ds_train("launch", "--help", timeout=60)
    assert res.returncode == 0 and "--hostfile" in res.out and "deepspeed launcher flags" in res.out
