#!/usr/bin/env bash
# Run Terraform and checkov offline: inside a network namespace that has only loopback, with
# CHECKPOINT_DISABLE=1 and TF_CLI_CONFIG_FILE=terraform/offline.tfrc (no provider source).
#
#   netns.sh run CMD...          a throw-away namespace for one command (fmt, validate, checkov)
#   netns.sh create NAME         a named namespace that outlives one command (envs/local: the
#   netns.sh exec NAME CMD...    processes that apply starts live in it until destroy)
#   netns.sh delete NAME         refuses while processes still run inside NAME (exit 3)
#
# Needs root (ip netns). Processes in the namespace reach only its own 127.0.0.1.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export CHECKPOINT_DISABLE=1
export TF_CLI_CONFIG_FILE="$here/offline.tfrc"
export TF_IN_AUTOMATION=1

usage() { echo "usage: $0 run CMD... | create NAME | exec NAME CMD... | delete NAME" >&2; exit 2; }

create() {
  ip netns add "$1"
  ip netns exec "$1" ip link set lo up
}

delete() {
  local pids
  pids=$(ip netns pids "$1" 2>/dev/null || true)
  if [[ -n "$pids" ]]; then
    echo "netns $1 still has processes: $pids" >&2
    return 3
  fi
  ip netns delete "$1" 2>/dev/null || true
}

case "${1:-}" in
  run)
    shift
    (($# > 0)) || usage
    ns="prfaas-tf-$$-$RANDOM"
    create "$ns"
    trap 'ip netns delete "$ns" 2>/dev/null || true' EXIT
    ip netns exec "$ns" "$@"
    ;;
  create) (($# == 2)) || usage; create "$2" ;;
  exec) (($# > 2)) || usage; ns=$2; shift 2; exec ip netns exec "$ns" "$@" ;;
  delete) (($# == 2)) || usage; delete "$2" ;;
  *) usage ;;
esac
