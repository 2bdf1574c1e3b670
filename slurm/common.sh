# Shared by the farm's Slurm scripts (sourced, not run).
#
# PRORL_SHARED   a directory on the shared filesystem (required): the head publishes its
#                address and credentials there (head.env, mode 0600), logs go to logs/.
# PRORL_FARM_DIR the project checkout (default: where sbatch was run).
# PRORL_PYTHON   the Python with the farm installed (default: $PRORL_FARM_DIR/.venv/bin/python).

set -euo pipefail

: "${PRORL_SHARED:?set PRORL_SHARED to a directory on the shared filesystem}"
PRORL_FARM_DIR=${PRORL_FARM_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
PY=${PRORL_PYTHON:-$PRORL_FARM_DIR/.venv/bin/python}
HEAD_ENV="$PRORL_SHARED/head.env"
LOG_DIR=${PRORL_LOG_DIR:-$PRORL_SHARED/logs}
export PYTHONPATH="$PRORL_FARM_DIR${PYTHONPATH:+:$PYTHONPATH}"

if [ ! -x "$PY" ]; then
  echo "prorl-farm: no Python at $PY (run 'make bootstrap' in $PRORL_FARM_DIR, or set PRORL_PYTHON)" >&2
  exit 2
fi
umask 077
mkdir -p "$PRORL_SHARED" "$LOG_DIR"

say() { echo "[$(date +%H:%M:%S)] $*"; }

secret() { "$PY" -c 'import secrets; print(secrets.token_urlsafe(24))'; }

# wait_http URL SECONDS: until URL answers 200.
wait_http() {
  "$PY" - "$1" "$2" <<'PY'
import sys, time, urllib.request
url, end = sys.argv[1], time.monotonic() + float(sys.argv[2])
while True:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                sys.exit(0)
    except OSError:
        pass
    if time.monotonic() > end:
        sys.exit(f"{url} did not answer")
    time.sleep(0.5)
PY
}

# Children started with start_child run in the foreground of this script (never
# daemonised: Slurm must see and signal them); stop_children TERMs them and waits.
CHILDREN=()
CHILD_CMDS=()
CHILD_NAMES=()
CHILD_LOGS=()
start_child() {  # start_child NAME LOGFILE CMD...
  local name=$1 logf=$2; shift 2
  "$@" >>"$logf" 2>&1 &
  CHILDREN+=("$!")
  CHILD_NAMES+=("$name")
  CHILD_LOGS+=("$logf")
  CHILD_CMDS+=("$(printf '%q ' "$@")")
  say "started $name (pid $!), log $logf"
}
stop_children() {
  # Further signals are ignored while the children stop (scancel may signal twice): a
  # second TERM must not end this script, and run its EXIT cleanup, while they still run.
  trap '' TERM INT
  say "stopping: ${CHILDREN[*]}"
  kill -TERM "${CHILDREN[@]}" 2>/dev/null || true
  wait "${CHILDREN[@]}" 2>/dev/null || true
}
# restart_children: like supervise, but a child that dies (a pool killed by its watchdog,
# say) is started again (after a pause that grows with its restarts, at most a minute)
# instead of stopping the rest. Children must have been started with start_child.
restart_children() {
  trap 'stop_children; exit 0' TERM INT
  declare -A restarts=()
  set +e
  while true; do
    local pid
    wait -n -p pid "${CHILDREN[@]}"
    local code=$?
    [ -n "$pid" ] || { sleep 1; continue; }
    local i
    for i in "${!CHILDREN[@]}"; do
      [ "${CHILDREN[$i]}" = "$pid" ] || continue
      local n=${restarts[$i]:-0}
      restarts[$i]=$((n + 1))
      local pause=$(( n < 6 ? 1 << n : 60 ))
      say "${CHILD_NAMES[$i]} (pid $pid) exited (status $code); restarting in ${pause} s"
      sleep "$pause" &
      wait $!  # a signal meanwhile stops everything at once
      eval "${CHILD_CMDS[$i]}" >>"${CHILD_LOGS[$i]}" 2>&1 &
      CHILDREN[$i]=$!
      say "restarted ${CHILD_NAMES[$i]} (pid $!)"
    done
  done
}
# Wait in the foreground until a signal (clean stop, exit 0) or a child dies (exit 1).
supervise() {
  trap 'stop_children; exit 0' TERM INT
  set +e
  wait -n "${CHILDREN[@]}"
  local code=$?
  set -e
  say "a part exited (status $code); stopping the rest"
  stop_children
  exit 1
}
