#!/usr/bin/env bash
# Multi-node training from a hostfile: preflight every host over ssh, then the deepspeed launcher
# (pdsh). The arguments after the hostfile are the `train` command's:
#
#   bash scripts/launch_multi_node.sh HOSTFILE --config recipes/quickstart.yaml \
#       --ds-config ds_configs/zero3.json [key=value ...]
#   LAUNCH_ARGS="--num_gpus 4 --master_port 29600" bash scripts/launch_multi_node.sh HOSTFILE ...
#   CHECK=1 bash scripts/launch_multi_node.sh HOSTFILE ...      # the preflight only
#
# Every host needs password-less ssh, this same .venv path and this working directory; ssh options
# (an ssh config, a port) go through PDSH_SSH_ARGS_APPEND, as pdsh reads them.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 HOSTFILE --config C --ds-config D [key=value ...]" >&2
  exit 2
fi
hostfile=$1
shift
# The working directory stays the caller's: it is the one every node must have (paths in the
# arguments are relative to it).
root=$(cd "$(dirname "$0")/.." && pwd)
bash "$root/scripts/setup.sh"
export PATH="$root/.venv/bin:$PATH"
# LAUNCH_ARGS holds deepspeed launcher flags, split on spaces on purpose.
# shellcheck disable=SC2086
exec ds-train launch --hostfile "$hostfile" ${CHECK:+--check} ${LAUNCH_ARGS:-} -- train "$@"
