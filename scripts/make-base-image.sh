#!/usr/bin/env bash
# Make the local base image for the CPU stage image: Debian bookworm (minbase + python3)
# by debootstrap, loaded with `docker import`. No registry is needed.
#
# Cached by its inputs: the tarball under $EAGLE3_CACHE/base/ and the image tag
# eagle3-base:bookworm-<key> are reused when the suite, mirror and package list are the
# same. Prints the image reference on stdout (progress goes to stderr).
#
#   BASE_IMAGE=$(scripts/make-base-image.sh)
set -euo pipefail

SUITE=${EAGLE3_BASE_SUITE:-bookworm}
MIRROR=${EAGLE3_BASE_MIRROR:-http://deb.debian.org/debian}
INCLUDE=python3,python3-venv,ca-certificates
CACHE=${EAGLE3_CACHE:-/var/cache/eagle3ctl}

key=$(printf '%s\n' "$SUITE" "$MIRROR" "$INCLUDE" "v1" | sha256sum | cut -c1-12)
tag="eagle3-base:${SUITE}-${key}"
tarball="$CACHE/base/${SUITE}-${key}.tar.gz"

log() { echo "make-base-image: $*" >&2; }

if docker image inspect "$tag" >/dev/null 2>&1; then
  log "cached image $tag"
  echo "$tag"; exit 0
fi

if [ ! -s "$tarball" ]; then
  command -v debootstrap >/dev/null || { log "debootstrap is not installed (apt-get install debootstrap)"; exit 1; }
  mkdir -p "$CACHE/base"
  root=$(mktemp -d "$CACHE/base/rootfs.XXXXXX")
  trap 'rm -rf "$root"' EXIT
  log "debootstrap $SUITE (minbase + $INCLUDE) from $MIRROR into $root"
  start=$(date +%s)
  debootstrap --variant=minbase --include="$INCLUDE" "$SUITE" "$root" "$MIRROR" >"$root.log" 2>&1 \
    || { tail -20 "$root.log" >&2; log "debootstrap failed (log: $root.log)"; exit 1; }
  rm -f "$root.log"
  # Smaller and reproducible enough: no apt lists, caches or docs in the base.
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
         "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*
  tar -C "$root" --numeric-owner -czf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
  log "rootfs made in $(( $(date +%s) - start ))s: $(du -h "$tarball" | cut -f1)"
fi

log "docker import $tarball as $tag"
docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  "$tarball" "$tag" >/dev/null
echo "$tag"
