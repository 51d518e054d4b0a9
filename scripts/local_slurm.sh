#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine (Debian 12, SLURM 22.05) for tests that submit jobs.
#
#   bash scripts/local_slurm.sh        # installs what is missing, starts what is not running
#
# Idempotent: when munged, slurmctld and slurmd are up, answer `scontrol ping`/`sinfo` and
# /etc/slurm/slurm.conf is already what this script writes, it only prints the status line.
# Needs root. There is no systemd (PID 1 is not an init system here), so the daemons are started
# directly in their normal (self-daemonizing) mode; their pid files are what `alive` checks.
# All state lives outside the repository:
#   /etc/slurm/slurm.conf, /etc/munge/munge.key        configuration and the (generated) munge key
#   /var/spool/slurmctld, /var/spool/slurmd             controller state, node spool
#   /var/log/slurm/{slurmctld,slurmd}.log, /var/log/munge/munged.log
#   /var/log/slurm/apt-install.log                      output of the package installation, if any
# The last line on success is `slurm: one-node cluster <host> up (CPUs N)`; on failure one line
# `local_slurm: ...` explains what could not be set up, and the exit status is non-zero.
set -euo pipefail

host=$(hostname -s)
conf=/etc/slurm/slurm.conf
log_dir=/var/log/slurm
ctld_spool=/var/spool/slurmctld
slurmd_spool=/var/spool/slurmd
ctld_pid=/run/slurmctld.pid
slurmd_pid=/run/slurmd.pid
munge_pid=/run/munge/munged.pid
apt_log=$log_dir/apt-install.log

say() { echo "local_slurm: $*" >&2; }
die() { echo "local_slurm: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts system daemons)"

# ---------------------------------------------------------------------------------------------
# Packages: only when a command is missing, so the second run never touches apt.
# ---------------------------------------------------------------------------------------------
export PATH=$PATH:/usr/sbin:/sbin   # the daemons live in /usr/sbin, not always on a user's PATH
missing=()
for c in munged munge unmunge slurmctld slurmd sbatch srun scontrol sinfo squeue; do
  command -v "$c" >/dev/null 2>&1 || missing+=("$c")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing slurmd slurmctld slurm-client munge (missing: ${missing[*]}); log in $apt_log"
  mkdir -p "$log_dir"
  # Services are not started by the packages' maintainer scripts: without systemd, invoke-rc.d
  # defers to /usr/sbin/policy-rc.d (present in container images) or finds no init script.
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        slurmd slurmctld slurm-client munge >"$apt_log" 2>&1; then
    tail -n 20 "$apt_log" >&2
    die "apt-get install slurmd slurmctld slurm-client munge failed (full log: $apt_log; run apt-get update?)"
  fi
  for c in "${missing[@]}"; do
    command -v "$c" >/dev/null || die "$c still missing after installing the packages (see $apt_log)"
  done
fi

running_pid() {  # running_pid PID NAME: PID is a live NAME. PID 1 here is no init system and reaps
  # orphans late, so a daemon that exited can linger as a zombie for a while: kill -0 still
  # succeeds on it and /proc/PID/comm still names it, only the state in /proc/PID/stat says Z.
  local stat
  kill -0 "$1" 2>/dev/null && [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ] || return 1
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  stat=${stat##*) }   # the field after "(comm)" is the state letter
  [ "${stat%% *}" != Z ]
}

alive() {  # alive PIDFILE NAME: the process in PIDFILE is a live NAME (not exited, not a reused pid)
  local pid
  [ -s "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && running_pid "$pid" "$2"
}

stop() {  # stop PIDFILE NAME: TERM the daemon, by its pid, and wait for it (slurmd first waits for
  # its job steps' RPCs to finish, which takes ~10 s when a job is being killed)
  local pid i
  alive "$1" "$2" || return 0
  pid=$(cat "$1")
  kill "$pid" 2>/dev/null || true
  for i in $(seq 300); do running_pid "$pid" "$2" || return 0; sleep 0.1; done
  die "$2 (pid $pid) did not stop within 30 s"
}

wait_for() {  # wait_for SECONDS COMMAND...: poll COMMAND every 0.2 s, for up to SECONDS
  local secs=$1 i
  shift
  for i in $(seq $((secs * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  return 1
}

# ---------------------------------------------------------------------------------------------
# munge: slurm authenticates every RPC with it. munged refuses to start when its key or
# directories are missing or have loose permissions, so those are (re)set every time (cheap).
# ---------------------------------------------------------------------------------------------
id munge >/dev/null 2>&1 || die "user munge does not exist (the munge package creates it; reinstall munge)"
install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
install -d -o munge -g munge -m 0755 /run/munge   # /run is a tmpfs on real machines: recreated
if [ ! -s /etc/munge/munge.key ]; then
  say "creating /etc/munge/munge.key"
  if command -v mungekey >/dev/null; then
    mungekey --create --keyfile=/etc/munge/munge.key
  else
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  fi
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key

munge_ok() { munge -n </dev/null | unmunge >/dev/null; }
if ! alive "$munge_pid" munged || ! munge_ok 2>/dev/null; then
  stop "$munge_pid" munged
  # As the munge user, like the packaged service. A socket left behind by a killed munged is
  # removed by the new one itself (it holds munge.socket.2.lock while running).
  runuser -u munge -- munged >/dev/null 2>&1 \
    || die "munged did not start; see /var/log/munge/munged.log: $(tail -n 1 /var/log/munge/munged.log 2>/dev/null)"
  wait_for 10 munge_ok || die "munged started but munge -n | unmunge fails"
fi

# ---------------------------------------------------------------------------------------------
# slurm.conf: written only when it differs, so an unchanged cluster is not restarted.
# ---------------------------------------------------------------------------------------------
# `slurmd -C` prints what slurmd detects, e.g. "NodeName=vm CPUs=2 Boards=1 ... RealMemory=24105".
hw=$(slurmd -C 2>/dev/null | head -n 1) || die "slurmd -C failed: $(slurmd -C 2>&1 | tail -n 1)"
cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$hw")
mem=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
[ -n "$cpus" ] && [ -n "$mem" ] || die "could not read CPUs/RealMemory from slurmd -C: $hw"
# A node whose configured RealMemory exceeds what slurmd reports is drained ("Low RealMemory"):
# leave 5% slack for kernel memory accounting differences between boots.
mem=$((mem * 95 / 100))

desired=$(cat <<EOF
# Written by ds_train scripts/local_slurm.sh: a one-node test cluster. Edits are overwritten.
ClusterName=dstrain
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job (scontrol requeue, node failure) stays pending for cred_expire+1 seconds before it
# may start again (default 120 s, minimum 5): 10 s keeps requeue tests short.
AuthInfo=cred_expire=10
MpiDefault=none
# No cgroups: processes are tracked by parent pid, tasks are not bound to CPUs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
# No mail on this machine; the default /bin/mail is absent and slurmctld logs an error without this.
MailProg=/bin/true
# One CPU is the unit of allocation (no node topology is configured below, so each CPU counts as
# a core). The node offers twice its CPUs (config_overrides: slurmd takes the configured count
# over what it detects), so two 2-rank test jobs, which mostly wait, run side by side.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
# A node that was DOWN (e.g. slurmd killed) returns to service as soon as it registers again.
ReturnToService=2
KillWait=30
# Jobs end at their time limit (not up to OverTimeLimit minutes later).
OverTimeLimit=0
# Run the main scheduling loop every second (default 60 s): a submitted job starts at once on an
# idle node anyway, but a requeued job whose begin time has passed waits for this loop.
SchedulerParameters=sched_interval=1
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$ctld_spool
SlurmdSpoolDir=$slurmd_spool
SlurmctldPidFile=$ctld_pid
SlurmdPidFile=$slurmd_pid
SlurmctldLogFile=$log_dir/slurmctld.log
SlurmdLogFile=$log_dir/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=$host CPUs=$((2 * cpus)) RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
)

install -d -m 0755 /etc/slurm "$log_dir" "$ctld_spool" "$slurmd_spool"
if [ "$(cat "$conf" 2>/dev/null)" != "$desired" ]; then
  # Running daemons keep the old configuration (node definitions cannot be reconfigured live):
  # stop them first and write the file only then, so that a run interrupted in between still
  # leaves either the old file (retried next time) or stopped daemons (started with the new one).
  stop "$slurmd_pid" slurmd
  stop "$ctld_pid" slurmctld
  say "writing $conf"
  printf '%s\n' "$desired" >"$conf.tmp"
  mv "$conf.tmp" "$conf"
fi

# ---------------------------------------------------------------------------------------------
# Daemons, each started only when it is not running (both fork into the background themselves).
# ---------------------------------------------------------------------------------------------
ping_ok() { scontrol ping 2>/dev/null | grep -q 'is UP'; }
if ! alive "$ctld_pid" slurmctld || ! ping_ok; then
  stop "$ctld_pid" slurmctld
  slurmctld >>"$log_dir/slurmctld.out" 2>&1 \
    || die "slurmctld did not start: $(tail -n 1 "$log_dir/slurmctld.out") (see $log_dir/slurmctld.log)"
  wait_for 20 ping_ok \
    || die "slurmctld does not answer scontrol ping: $(grep -i -E 'error|fatal' "$log_dir/slurmctld.log" | tail -n 1)"
fi

if ! alive "$slurmd_pid" slurmd; then
  slurmd >>"$log_dir/slurmd.out" 2>&1 \
    || die "slurmd did not start: $(tail -n 1 "$log_dir/slurmd.out") (see $log_dir/slurmd.log)"
fi

node_state() { sinfo -h -N -n "$host" -o %T 2>/dev/null | head -n 1; }
# sinfo -o %T prints e.g. idle, mixed, allocated, completing; a trailing * means "not responding".
node_usable() {
  local s
  s=$(node_state)
  [ -n "$s" ] && ! [[ "$s" =~ down|drain|fail|unknown|maint|future|inval|\*$ ]]
}
if ! node_usable; then
  # A freshly started slurmd registers within a second or two ("unknown"/"idle*" until then);
  # a node that is down or drained is not waited for, it needs a resume.
  [[ "$(node_state)" =~ down|drain|fail ]] || wait_for 10 node_usable || true
  state=$(node_state)
  if [[ "$state" =~ down|drain|fail ]]; then
    # A DOWN/DRAIN state survives in the controller's saved state across restarts (e.g. the node
    # was drained by a failed job or marked DOWN when slurmd was killed): clear it.
    say "node $host is $state ($(scontrol show node "$host" | sed -n 's/^ *Reason=//p')); resuming"
    scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true
  fi
  wait_for 20 node_usable \
    || die "node $host is '$(node_state)', not idle: $(scontrol show node "$host" | sed -n 's/^ *Reason=//p') (see $log_dir/slurmd.log)"
fi

echo "slurm: one-node cluster $host up (CPUs $((2 * cpus)) offered, $cpus real)"
