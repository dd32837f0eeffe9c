#!/usr/bin/env bash
# Build the eagle3 images and report their sizes.
#
#   scripts/build-images.sh cpu            # CPU stage image on a local debootstrap base, offline
#   scripts/build-images.sh gpu            # GPU stage image on the pinned CUDA PyTorch base
#   scripts/build-images.sh serve          # vLLM + eagle3 (the generation server and client)
#   scripts/build-images.sh all
#
# Environment: REGISTRY (default: none, local names), TAG (default: the package version),
# BASE_IMAGE (overrides the variant's base), OFFLINE=1|0 (cpu defaults to 1: only the
# wheelhouse, built on the host from images/requirements.txt and cached), EAGLE3_CACHE.
# Push what was built with: docker push "$REGISTRY/eagle3:$TAG" (see docs/images.md).
set -euo pipefail
cd "$(dirname "$0")/.."

export DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0}  # the legacy builder: no buildx or frontend image to pull
CACHE=${EAGLE3_CACHE:-/var/cache/eagle3ctl}
PYTHON=${PYTHON:-$(command -v python3)}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
TAG=${TAG:-$VERSION}
PREFIX=${REGISTRY:+$REGISTRY/}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
GPU_BASE=${GPU_BASE:-pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime}
VLLM_IMAGE=${VLLM_IMAGE:-vllm/vllm-openai:v0.34.0}

log() { echo "build-images: $*" >&2; }

# Fill images/wheels/ with every pinned wheel (+ the CPU torch), from a cache keyed by the
# requirements, the torch version and the Python/platform the wheels are for.
fill_wheelhouse() {
  local with_torch=$1
  local pyver key dir
  pyver=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  key=$( { cat images/requirements.txt; echo "torch=$with_torch:$TORCH_VERSION py=$pyver $(uname -m)"; } | sha256sum | cut -c1-16)
  dir="$CACHE/wheels/$key"
  if [ ! -f "$dir/.complete" ]; then
    log "downloading pinned wheels (python $pyver) into $dir"
    mkdir -p "$dir"
    local extra=()
    [ "$with_torch" = 1 ] && extra=("torch==$TORCH_VERSION")
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
      -d "$dir" -r images/requirements.txt "${extra[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
    touch "$dir/.complete"
  else
    log "cached wheelhouse $dir"
  fi
  find images/wheels -mindepth 1 -maxdepth 1 ! -name .gitignore ! -name README.md -exec rm -rf {} +
  cp -l "$dir"/*.whl images/wheels/ 2>/dev/null || cp "$dir"/*.whl images/wheels/
}

clear_wheelhouse() {
  find images/wheels -mindepth 1 -maxdepth 1 ! -name .gitignore ! -name README.md -exec rm -rf {} +
}

# A rebuilt tag leaves the previous runtime image dangling: drop those (never the
# unlabelled deps-stage images, which are the layer cache).
prune_replaced() {
  docker image prune -f --filter "label=org.opencontainers.image.title=$1" >/dev/null || true
}

report_size() {
  local ref=$1 bytes
  bytes=$(docker image inspect -f '{{.Size}}' "$ref")
  printf 'build-images: %-40s %8s MB\n' "$ref" "$(( bytes / 1000000 ))" >&2
  echo "$ref $bytes" >> "${SIZES_FILE:-/dev/null}"
}

build_cpu() {
  local base=${BASE_IMAGE:-$(scripts/make-base-image.sh)}
  local offline=${OFFLINE:-1} net=()
  if [ "$offline" = 1 ]; then fill_wheelhouse 1; net=(--network none); else clear_wheelhouse; fi
  local ref="${PREFIX}eagle3-cpu:${TAG}"
  log "building $ref on $base (offline=$offline)"
  docker build "${net[@]}" -f Dockerfile \
    --build-arg BASE_IMAGE="$base" --build-arg VARIANT=cpu --build-arg OFFLINE="$offline" \
    --build-arg TORCH_VERSION="$TORCH_VERSION" --build-arg VERSION="$VERSION" \
    -t "$ref" . >&2
  clear_wheelhouse
  prune_replaced eagle3
  report_size "$ref"
  echo "$ref"
}

build_gpu() {
  local base=${BASE_IMAGE:-$GPU_BASE} offline=${OFFLINE:-0}
  # The GPU wheelhouse would be for the base's Python, which is only known inside it.
  if [ "$offline" = 1 ]; then fill_wheelhouse 0; else clear_wheelhouse; fi
  local ref="${PREFIX}eagle3:${TAG}"
  log "building $ref on $base (offline=$offline)"
  docker build -f Dockerfile --build-arg BASE_IMAGE="$base" --build-arg VARIANT=gpu \
    --build-arg OFFLINE="$offline" --build-arg VERSION="$VERSION" -t "$ref" . >&2
  clear_wheelhouse
  prune_replaced eagle3
  report_size "$ref"
  echo "$ref"
}

build_serve() {
  local ref="${PREFIX}eagle3-serve:${TAG}"
  clear_wheelhouse
  log "building $ref on $VLLM_IMAGE"
  docker build -f images/serve.Dockerfile --build-arg VLLM_IMAGE="$VLLM_IMAGE" \
    --build-arg VERSION="$VERSION" -t "$ref" . >&2
  prune_replaced eagle3-serve
  report_size "$ref"
  echo "$ref"
}

case "${1:-}" in
  cpu) build_cpu ;;
  gpu) build_gpu ;;
  serve) build_serve ;;
  all) build_cpu; build_gpu; build_serve ;;
  *) echo "usage: $0 cpu|gpu|serve|all" >&2; exit 2 ;;
esac
