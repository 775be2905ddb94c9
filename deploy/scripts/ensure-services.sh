#!/usr/bin/env bash
# Make sure the real services the test suite talks to are up: PostgreSQL, Redis, a Docker daemon
# (host networking only: no bridge, no iptables) and Chromium. Starts or installs what is missing;
# leaves running whatever was already running. Prints the environment the tests need on stdout.
set -euo pipefail

log() { echo "[services] $*" >&2; }
as_root() { [ "$(id -u)" -eq 0 ] || { log "need root to $*"; exit 1; }; }
apt_install() {
  as_root "install $*"
  if [ -z "${_apt_updated:-}" ]; then apt-get update -qq >&2; _apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >&2
}
wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local seconds=$1 what=$2; shift 2
  for _ in $(seq 1 $((seconds * 4))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.25; done
  log "$what did not come up within ${seconds}s"; return 1
}

# PostgreSQL on 127.0.0.1:5432.
command -v pg_ctlcluster >/dev/null || apt_install postgresql postgresql-client
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  log "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -n 1)" main start >&2
  wait_for 30 PostgreSQL pg_isready -q -h 127.0.0.1 -p 5432
fi

# Redis on 127.0.0.1:6379, keeping nothing on disk.
command -v redis-server >/dev/null || apt_install redis-server
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  log "starting Redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/berth-test.log >&2
  wait_for 15 Redis redis-cli -h 127.0.0.1 -p 6379 ping
fi

# Docker: our own daemon with no bridge network (its 172.17.x bridge is off limits), reused across runs.
docker_dir=${BERTH_TEST_DOCKER_DIR:-/var/tmp/berth-docker}
docker_sock="$docker_dir/docker.sock"
command -v dockerd >/dev/null || apt_install docker.io
if ! DOCKER_HOST="unix://$docker_sock" docker version >/dev/null 2>&1; then
  log "starting dockerd under $docker_dir"
  as_root "start dockerd"
  mkdir -p "$docker_dir/data" "$docker_dir/exec"
  nohup dockerd --data-root "$docker_dir/data" --exec-root "$docker_dir/exec" -H "unix://$docker_sock" \
    --pidfile "$docker_dir/dockerd.pid" --bridge=none --iptables=false --ip6tables=false \
    >"$docker_dir/dockerd.log" 2>&1 &
  wait_for 60 dockerd env DOCKER_HOST="unix://$docker_sock" docker version
fi

# Chromium for the browser tests (never a test tool's own browser download).
[ -x /usr/bin/chromium ] || apt_install chromium

# promtool (Debian's prometheus package) for the alert rules' fixtures (deploy/prometheus/alerts_test.yml).
command -v promtool >/dev/null || apt_install prometheus

echo "DOCKER_HOST=unix://$docker_sock"
echo "BERTH_TEST_CHROMIUM=/usr/bin/chromium"
