#!/usr/bin/env bash
# Start or stop one long-running process for Terraform's local-exec provisioners.
#
#   procctl.sh start NAME RUN_DIR READY_TIMEOUT_S READY_CMD -- COMMAND [ARGS...]
#   procctl.sh stop  NAME RUN_DIR STOP_TIMEOUT_S
#
# start: runs COMMAND in a session of its own (setsid), detached from Terraform (stdin
# /dev/null, output to RUN_DIR/NAME.log), records "PID STARTTIME" in RUN_DIR/NAME.pid, then
# polls READY_CMD (a shell command; empty = "still alive after 1 s") every 0.2 s until it
# succeeds. A process that exits or is not ready within READY_TIMEOUT_S is killed and the
# log tail printed: the apply fails instead of leaving a half-started process behind.
# stop: SIGTERM to the process group, SIGKILL after STOP_TIMEOUT_S, PID file removed.
# Idempotent: no PID file, or a PID now owned by another process (start time differs:
# the PID was reused), is "already stopped".
set -euo pipefail

usage() { echo "usage: $0 start NAME RUN_DIR READY_TIMEOUT_S READY_CMD -- CMD... | stop NAME RUN_DIR STOP_TIMEOUT_S" >&2; exit 2; }

stat_fields() { # the fields of /proc/PID/stat after "(comm)", which may itself hold spaces
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  echo "${stat##*) }"
}

start_time() { # field 22 of /proc/PID/stat: clock ticks since boot
  local fields
  fields=$(stat_fields "$1") || return 1
  set -- $fields
  echo "${20}"
}

alive() { # PID STARTTIME: the recorded process still runs (and is not a zombie)
  local fields want=$2
  fields=$(stat_fields "$1") || return 1
  set -- $fields
  [[ "${20}" == "$want" && "$1" != Z && "$1" != X ]]
}

stop() {
  local name=$1 run_dir=$2 timeout_s=$3 pidfile pid start deadline
  pidfile="$run_dir/$name.pid"
  if [[ ! -f "$pidfile" ]]; then
    echo "$name: not running (no $pidfile)"
    return 0
  fi
  read -r pid start <"$pidfile" || true
  if [[ -z "${pid:-}" || -z "${start:-}" ]] || ! alive "$pid" "$start"; then
    echo "$name: not running (stale $pidfile)"
    rm -f "$pidfile"
    return 0
  fi
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  deadline=$((SECONDS + timeout_s))
  while alive "$pid" "$start" && ((SECONDS < deadline)); do sleep 0.1; done
  if alive "$pid" "$start"; then
    echo "$name: pid $pid ignored SIGTERM for ${timeout_s}s; SIGKILL"
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
    deadline=$((SECONDS + 10))
    while alive "$pid" "$start" && ((SECONDS < deadline)); do sleep 0.1; done
  fi
  # the group's other members (none expected) go too
  kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$pidfile"
  echo "$name: stopped pid $pid"
}

start() {
  local name=$1 run_dir=$2 timeout_s=$3 ready_cmd=$4 pidfile log pid start deadline
  shift 4
  [[ "${1:-}" == "--" ]] || usage
  shift
  (($# > 0)) || usage
  mkdir -p "$run_dir"
  pidfile="$run_dir/$name.pid"
  log="$run_dir/$name.log"
  stop "$name" "$run_dir" 10 >/dev/null # a leftover of an interrupted run
  setsid "$@" </dev/null >"$log" 2>&1 &
  pid=$!
  start=""
  for _ in $(seq 50); do start=$(start_time "$pid") && break; sleep 0.02; done
  echo "$pid $start" >"$pidfile"
  deadline=$((SECONDS + timeout_s))
  if [[ -z "$ready_cmd" ]]; then
    sleep 1
    ready_cmd=true
  fi
  while ((SECONDS < deadline)); do
    if ! alive "$pid" "$start"; then
      echo "$name: exited during start; last lines of $log:" >&2
      tail -n 30 "$log" >&2
      rm -f "$pidfile"
      exit 1
    fi
    if bash -c "$ready_cmd" >/dev/null 2>&1; then
      echo "$name: ready (pid $pid, log $log)"
      return 0
    fi
    sleep 0.2
  done
  echo "$name: not ready within ${timeout_s}s; stopping it. Last lines of $log:" >&2
  tail -n 30 "$log" >&2
  stop "$name" "$run_dir" 5 >&2
  exit 1
}

case "${1:-}" in
  start) shift; (($# >= 5)) || usage; start "$@" ;;
  stop) shift; (($# == 3)) || usage; stop "$@" ;;
  *) usage ;;
esac
