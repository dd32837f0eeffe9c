#!/usr/bin/env bash
# Make a Docker engine usable on this machine for the container tests (CI and developers):
# install Debian's docker.io + debootstrap if missing, start dockerd in the background if
# none answers, wait for it, and make (or reuse) the cached local base image.
#
# What works on a CI host (see docs/images.md): dockerd with its defaults (overlay2,
# cgroupfs v1, the docker0 bridge); containers run with --network host so they reach the
# test's servers on 127.0.0.1. If the default start fails we retry without iptables and
# the bridge, then with the vfs storage driver.
set -euo pipefail
cd "$(dirname "$0")/.."

LOG=${EAGLE3_DOCKERD_LOG:-/var/log/eagle3-dockerd.log}
log() { echo "ci-docker: $*" >&2; }

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
  log "installing docker.io and debootstrap"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  # With recommends, as verified here (debootstrap wants debian-archive-keyring to check signatures).
  apt-get install -y -q docker.io debootstrap debian-archive-keyring >/dev/null
fi

engine_up() { timeout 10 docker info >/dev/null 2>&1; }

wait_engine() {
  local pid=$1
  for _ in $(seq 1 60); do
    engine_up && return 0
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

start_dockerd() {
  # A dockerd killed with its login session leaves its pid file behind; it refuses to start then.
  if [ -f /var/run/docker.pid ] && ! kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then
    rm -f /var/run/docker.pid
  fi
  log "starting dockerd $* (log: $LOG)"
  nohup dockerd "$@" >>"$LOG" 2>&1 </dev/null &
  local pid=$!
  if wait_engine "$pid"; then return 0; fi
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  return 1
}

if engine_up; then
  log "Docker engine already running"
else
  start_dockerd \
    || start_dockerd --iptables=false --bridge=none \
    || start_dockerd --iptables=false --bridge=none --storage-driver=vfs \
    || { tail -20 "$LOG" >&2; log "dockerd did not start"; exit 1; }
fi
docker info --format 'ci-docker: engine {{.ServerVersion}}, storage {{.Driver}}, cgroup v{{.CgroupVersion}}' >&2

base=$(scripts/make-base-image.sh)
log "base image $base"
