#!/usr/bin/env bash
# One worker node: the INIT, RUN and EVAL pools for this node's queues, in the foreground.
# Reads the head's address from $PRORL_SHARED/head.env (waits up to PRORL_HEAD_WAIT_S for it).
# On SIGTERM (scancel) the pools hand what they hold back to INIT for other nodes
# (PRORL_REQUEUE_ON_STOP=1) and exit; the node's sandboxes go with it. A pool that dies
# otherwise (a wedged pool killed by its watchdog, say) is started again; the reaper
# recovers its jobs.
#
# Environment: PRORL_NODE (default: <host>-j<job id>, one per array task), pool sizes
# (PRORL_INIT_CONCURRENCY, PRORL_RUN_CONCURRENCY, PRORL_EVAL_CONCURRENCY), pool processes
# per stage (PRORL_RUN_PROCESSES, ...; default 1) and any PRORL_* setting of the pools.
here=$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")
source "$here/common.sh"

wait_s=${PRORL_HEAD_WAIT_S:-600}
for _ in $(seq "$((wait_s * 2))"); do
  [ -f "$HEAD_ENV" ] && break
  sleep 0.5
done
[ -f "$HEAD_ENV" ] || { echo "prorl-farm: no $HEAD_ENV after ${wait_s} s: is the head running?" >&2; exit 1; }
set -a; source "$HEAD_ENV"; set +a

export PRORL_NODE=${PRORL_NODE:-$(hostname -s)-j${SLURM_JOB_ID:-$$}}
export PRORL_REQUEUE_ON_STOP=${PRORL_REQUEUE_ON_STOP:-1}
# Node-local: sandboxes live and die with the node (short: Unix socket paths are limited).
export PRORL_SANDBOX_DIR=${PRORL_SANDBOX_DIR:-/tmp/prs-$PRORL_NODE}
export PRORL_HOME=${PRORL_HOME:-/tmp/prorl-$PRORL_NODE}

for stage in init run eval; do
  processes_var="PRORL_${stage^^}_PROCESSES"  # pool processes of the stage on this node
  processes=${!processes_var:-1}
  if [ "$processes" = 1 ]; then
    start_child "$stage pool" "$LOG_DIR/$PRORL_NODE.$stage.log" "$PY" -m prorl_farm.cli worker "$stage"
  else
    for i in $(seq 0 "$((processes - 1))"); do
      start_child "$stage pool $i" "$LOG_DIR/$PRORL_NODE.$stage-$i.log" "$PY" -m prorl_farm.cli worker "$stage"
    done
  fi
done
say "worker node $PRORL_NODE: pools started, head $PRORL_URL"
# A pool's own processes (its prefork children) can outlive it by a moment and make its
# sandbox directory again: the directories go once no process of this node is left.
node_processes() {  # (the list is expanded before any grep runs: none of them is in it)
  local f
  for f in /proc/[0-9]*/environ; do
    [ "$f" = "/proc/$$/environ" ] && continue
    grep -qsxz "PRORL_NODE=$PRORL_NODE" "$f" && return 0
  done
  return 1
}
cleanup() {
  for _ in $(seq 50); do node_processes || break; sleep 0.2; done
  rm -rf "$PRORL_SANDBOX_DIR" "$PRORL_HOME"
}
trap cleanup EXIT
restart_children  # a pool that dies (killed by its watchdog, say) is started again
