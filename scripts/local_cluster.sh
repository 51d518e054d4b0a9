#!/usr/bin/env bash
# A two-"node" cluster on this machine, for testing multi-node launches through real pdsh and ssh.
#
#   eval "$(bash scripts/local_cluster.sh up)"    # prints the environment to use, writes a hostfile
#   ds-train launch --hostfile "$DS_TRAIN_CLUSTER_HOSTFILE" -- train --config C --ds-config D
#   bash scripts/local_cluster.sh down            # stops sshd, removes the state
#
# One sshd listens on the loopback addresses 127.0.0.2 and 127.0.0.3 (port $DS_TRAIN_CLUSTER_PORT,
# default 2222) with a throwaway host key and user key; its ssh client config lives in the state
# directory ($DS_TRAIN_CLUSTER_DIR, default /tmp/ds_train_cluster) and reaches pdsh and the
# preflight through PDSH_SSH_ARGS_APPEND="-F <config>"; DS_TRAIN_ONE_MACHINE tells the preflight that
# both names are this one machine on purpose. Nothing in ~/.ssh or /etc/ssh is touched.
# Both commands are idempotent. Needs /usr/sbin/sshd and pdsh (scripts/test.sh installs them).
#
# Node-local disks: with DS_TRAIN_CLUSTER_NODE_LOCAL=<dir> (root only), each node gets its own sshd
# in its own mount namespace, where <state>/node<i> is mounted over <dir>: a run whose output_dir is
# <dir> then sees one directory per node, as on a cluster with local NVMe (no shared file system).
set -euo pipefail

state=${DS_TRAIN_CLUSTER_DIR:-/tmp/ds_train_cluster}
port=${DS_TRAIN_CLUSTER_PORT:-2222}
sshd=${SSHD:-/usr/sbin/sshd}
nodes=(127.0.0.2 127.0.0.3)
node_local=${DS_TRAIN_CLUSTER_NODE_LOCAL:-}

say() { echo "local_cluster: $*" >&2; }

pidfiles() {  # one sshd, or one per node (node-local)
  if [ -n "$node_local" ]; then echo "$state/sshd0.pid" "$state/sshd1.pid"; else echo "$state/sshd.pid"; fi
}

alive() {  # the sshd whose pid file is $1
  [ -f "$1" ] || return 1
  local pid
  pid=$(cat "$1")
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && grep -q sshd "/proc/$pid/cmdline" 2>/dev/null
}

running() {  # the sshd(s) started by `up`, by the pids they wrote
  local f
  for f in $(pidfiles); do alive "$f" || return 1; done
}

print_env() {
  # stdout is meant for eval; everything else goes to stderr.
  printf "export PDSH_RCMD_TYPE=ssh PDSH_SSH_ARGS_APPEND='-F %s/ssh_config'\n" "$state"
  printf "export DS_TRAIN_CLUSTER_HOSTFILE='%s/hostfile'\n" "$state"
  # Both "nodes" are this machine, on purpose: the preflight refuses two names of one machine unless told.
  printf "export DS_TRAIN_ONE_MACHINE='%s'\n" "$(IFS=,; echo "${nodes[*]}")"
}

up() {
  if [ ! -x "$sshd" ] || ! command -v pdsh >/dev/null || ! command -v ssh >/dev/null; then
    say "needs $sshd, ssh and pdsh; install them with: apt-get install -y openssh-server pdsh" \
        "(bash scripts/test.sh does it)"
    exit 1
  fi
  if running; then
    say "already up (sshd pid $(cat "$state/sshd.pid"), ${nodes[*]} port $port)"
    print_env
    return
  fi
  rm -rf "$state"
  mkdir -p "$state"
  chmod 700 "$state"
  ssh-keygen -q -t ed25519 -N '' -C ds_train_cluster_host -f "$state/host_key"
  ssh-keygen -q -t ed25519 -N '' -C ds_train_cluster_user -f "$state/id_ed25519"
  cp "$state/id_ed25519.pub" "$state/authorized_keys"
  : > "$state/known_hosts"
  for node in "${nodes[@]}"; do
    echo "[$node]:$port $(cut -d' ' -f1-2 "$state/host_key.pub")" >> "$state/known_hosts"
  done
  cat > "$state/sshd_config" <<EOF
ListenAddress ${nodes[0]}:$port
ListenAddress ${nodes[1]}:$port
HostKey $state/host_key
PidFile $state/sshd.pid
AuthorizedKeysFile $state/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
# The state directory lives under /tmp (world-writable), which StrictModes would refuse.
StrictModes no
UsePAM no
MaxStartups 100
LogLevel ERROR
EOF
  cat > "$state/ssh_config" <<EOF
Host 127.0.0.*
  Port $port
  User $(id -un)
  IdentityFile $state/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile $state/known_hosts
  StrictHostKeyChecking yes
  BatchMode yes
  LogLevel ERROR
EOF
  printf '%s slots=1\n' "${nodes[@]}" > "$state/hostfile"
  if [ "$(id -u)" = 0 ]; then
    mkdir -p /run/sshd  # sshd's privilege-separation directory, missing where sshd never ran
  fi
  if [ -z "$node_local" ]; then
    "$sshd" -f "$state/sshd_config" -E "$state/sshd.log"
  else
    [ "$(id -u)" = 0 ] || { say "DS_TRAIN_CLUSTER_NODE_LOCAL needs root (mount namespaces)"; exit 1; }
    mkdir -p "$node_local"
    for i in 0 1; do
      mkdir -p "$state/node$i"
      grep -v '^ListenAddress\|^PidFile' "$state/sshd_config" > "$state/sshd${i}_config"
      printf 'ListenAddress %s:%s\nPidFile %s\n' "${nodes[i]}" "$port" "$state/sshd$i.pid" >> "$state/sshd${i}_config"
      # sshd daemonises inside the namespace; its sessions (the ranks) inherit the mount.
      unshare -m --propagation private sh -c 'mount --bind "$1" "$2" && exec "$3" -f "$4" -E "$5"' \
        sh "$state/node$i" "$node_local" "$sshd" "$state/sshd${i}_config" "$state/sshd$i.log"
    done
  fi
  for _ in $(seq 50); do
    if running && ssh -F "$state/ssh_config" "${nodes[1]}" true 2>/dev/null; then
      say "up: sshd pid(s) $(cat $(pidfiles) | tr '\n' ' ')on ${nodes[*]} port $port; hostfile $state/hostfile"
      print_env
      return
    fi
    sleep 0.1
  done
  say "sshd did not come up; its log:"
  cat "$state"/sshd*.log >&2 || true
  down
  exit 1
}

down() {
  local f pid
  for f in $(pidfiles); do
    if alive "$f"; then
      pid=$(cat "$f")
      kill "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      say "down: stopped sshd pid $pid"
    fi
  done
  rm -rf "$state"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
