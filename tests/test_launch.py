"""ds_train.launch: hostfile parsing, .deepspeed_env, shell safety, sbatch scripts, the launch CLI.

Pure functions are tested directly; the CLI runs in a subprocess. Nothing here needs ssh (the real
two-node launch is in test_multinode.py).
"""

from __future__ import annotations

import re
import shlex
import stat
import subprocess
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ROOT, ds_train, tiny_config, write_config
from ds_train.configfile import describe, load_config
from ds_train.errors import UserError
from ds_train.launch import envfile
from ds_train.launch.hostfile import Host, is_valid_host, parse_hostfile, read_hostfile, select_hosts
from ds_train.launch.preflight import HostProbe, SshOptions, check_probes, check_shell_safe, pick_master
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


def test_launch_env_config_key():
    model = "model.config.model_type=llama"
    cfg = load_config(None, [model, "launch.env=[WANDB_API_KEY, MY_VAR]"])
    assert cfg.launch.env == ["WANDB_API_KEY", "MY_VAR"]
    with pytest.raises(UserError, match=r"launch.env: 'A-B', 'x y' not a variable name"):
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
              _probe("f", python="/other/python")]
    problems = check_probes(probes, "/venv/bin/python", "/work", versions, "3.11.7")
    text = "\n".join(problems)
    assert "unreachable: b, c;" in text
    assert "d: torch 2.4.0 (here 2.13.0)" in text
    assert "e: working directory /work does not exist" in text
    assert "f: Python /other/python" in text
    assert not any(p.startswith("a:") for p in problems)


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
    assert shlex.split(srun) == ["srun", "--kill-on-bad-exit=1", "--cpus-per-task", "6", "/venv/bin/python", "-u",
                                 "-m", "ds_train", "train", "--config", "recipes/a b.yaml", "--ds-config",
                                 "ds_configs/zero3.json"]
    assert 'if [ "$code" -eq 138 ]; then' in script and 'scontrol requeue "$SLURM_JOB_ID"' in script


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


def test_slurm_cli_writes_the_script_and_checks_the_batch_math(run_config, tmp_path):
    out = tmp_path / "job.sbatch"
    res = ds_train("slurm", "--nodes", "2", "--gpus-per-node", "2", "--partition", "debug", "--requeue",
                   "--out", str(out), "--", "train", "--config", str(run_config), "--ds-config", ZERO2,
                   "train.max_steps=3", timeout=60)
    assert res.returncode == 0, res.out
    assert f"sbatch {out}" in res.out
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


def test_launch_help():
    res = ds_train("launch", "--help", timeout=60)
    assert res.returncode == 0 and "--hostfile" in res.out and "deepspeed launcher flags" in res.out
