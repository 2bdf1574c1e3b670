#!/usr/bin/env bash
# The farm's head: Redis (append-only, password), the API (token), Flower (basic auth) and
# the NeMo Gym agent server, in the foreground. Publishes $PRORL_SHARED/head.env for the
# worker nodes and clients: PRORL_REDIS_URL, PRORL_URL, PRORL_API_TOKEN, PRORL_FLOWER_URL,
# PRORL_FLOWER_BASIC_AUTH, PRORL_GYM_URL.
#
# Environment: PRORL_HEAD_HOST (the name workers reach, default: this host),
# PRORL_REDIS_PORT (6379), PRORL_API_PORT (8000), PRORL_FLOWER_PORT (5555),
# PRORL_GYM_PORT (8010; 0: no Gym agent server), PRORL_API_TOKEN,
# PRORL_FLOWER_BASIC_AUTH (user:password), PRORL_REDIS_DIR (default $PRORL_SHARED/redis),
# PRORL_REDIS_APPENDFSYNC (everysec or always), and any PRORL_* setting of the API.
here=$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")
source "$here/common.sh"

host=${PRORL_HEAD_HOST:-$(hostname -f 2>/dev/null || hostname)}
redis_port=${PRORL_REDIS_PORT:-6379}
api_port=${PRORL_API_PORT:-8000}
flower_port=${PRORL_FLOWER_PORT:-5555}
gym_port=${PRORL_GYM_PORT:-8010}
redis_dir=${PRORL_REDIS_DIR:-$PRORL_SHARED/redis}
appendfsync=${PRORL_REDIS_APPENDFSYNC:-everysec}
case $appendfsync in
  everysec|always) ;;
  *) echo "PRORL_REDIS_APPENDFSYNC: everysec or always, not '$appendfsync'" >&2; exit 2 ;;
esac
mkdir -p "$redis_dir"

# A restarted head keeps its credentials, so running worker nodes reconnect.
if [ -f "$HEAD_ENV" ]; then
  set -a; source "$HEAD_ENV"; set +a
  password=${PRORL_REDIS_PASSWORD:-}
fi
password=${password:-$(secret)}
token=${PRORL_API_TOKEN:-$(secret)}
flower_auth=${PRORL_FLOWER_BASIC_AUTH:-prorl:$(secret)}
rm -f "$HEAD_ENV"

# The password in a 0600 config file, not on a command line other users can read.
conf="$redis_dir/redis.conf"
cat >"$conf" <<CONF
port $redis_port
bind 0.0.0.0
requirepass $password
dir $redis_dir
appendonly yes
appendfsync $appendfsync
save ""
hash-max-listpack-value 1024
daemonize no
CONF
url="redis://:$password@$host:$redis_port/0"

start_child redis "$LOG_DIR/head-redis.log" redis-server "$conf"
export PRORL_REDIS_URL=$url PRORL_API_HOST=0.0.0.0 PRORL_API_PORT=$api_port \
       PRORL_API_TOKEN=$token
"$PY" - "$url" <<'PY'
import sys, time, redis
r, end = redis.Redis.from_url(sys.argv[1]), time.monotonic() + 120
while True:
    try:
        r.ping(); break
    except redis.exceptions.BusyLoadingError:
        pass  # loading a large append-only file
    except redis.exceptions.ConnectionError:
        pass
    if time.monotonic() > end:
        sys.exit("redis did not start")
    time.sleep(0.2)
PY
start_child api "$LOG_DIR/head-api.log" "$PY" -m prorl_farm.cli api
FLOWER_BASIC_AUTH=$flower_auth start_child flower "$LOG_DIR/head-flower.log" \
  "$PY" -m celery -A prorl_farm.celery_app --broker "$url" flower \
  --port="$flower_port" --address=0.0.0.0
wait_http "http://127.0.0.1:$api_port/healthz" 120
gym_url=
if [ "$gym_port" != 0 ]; then
  start_child gym "$LOG_DIR/head-gym.log" "$PY" -m prorl_farm.cli gym --host 0.0.0.0 \
    --port "$gym_port" --farm "http://127.0.0.1:$api_port"
  wait_http "http://127.0.0.1:$gym_port/healthz" 60
  gym_url=http://$host:$gym_port
fi

tmp="$HEAD_ENV.tmp.$$"
cat >"$tmp" <<ENV
PRORL_REDIS_URL=$url
PRORL_REDIS_PASSWORD=$password
PRORL_URL=http://$host:$api_port
PRORL_API_TOKEN=$token
PRORL_FLOWER_URL=http://$host:$flower_port
PRORL_FLOWER_BASIC_AUTH=$flower_auth
PRORL_GYM_URL=$gym_url
PRORL_HEAD_JOB=${SLURM_JOB_ID:-}
ENV
mv "$tmp" "$HEAD_ENV"
say "head up: API http://$host:$api_port, Flower http://$host:$flower_port${gym_url:+, Gym $gym_url}; $HEAD_ENV written"
supervise
