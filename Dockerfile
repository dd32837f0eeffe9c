# The eagle3 stage image: one Dockerfile, two variants chosen by build arguments.
#
#   GPU (extract / train / evaluate; the default): a CUDA PyTorch base, whose torch is used as is.
#     docker build -t REGISTRY/eagle3:TAG .
#   CPU (generate / vocab / export, and the tests): any Debian-like base with python3 >= 3.10
#   and venv; torch is the CPU wheel TORCH_VERSION.
#     docker build --build-arg BASE_IMAGE=debian:bookworm-slim-with-python --build-arg VARIANT=cpu .
#
# Every Python distribution is pinned by images/requirements.txt (images/lock.py writes it).
# OFFLINE=1 installs only from the wheelhouse images/wheels/ (scripts/build-images.sh fills
# it), for builds whose network cannot reach a package index.
# The entrypoint is the stage CLI: `docker run IMAGE stage vocab -c /config/run.yaml`.

ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime

# ---- deps: a venv holding the pinned dependencies (the slow, rarely changing layer) ----
FROM ${BASE_IMAGE} AS deps
ARG VARIANT=gpu
ARG TORCH_VERSION=2.13.0
ARG OFFLINE=0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_FIND_LINKS=/wheels PIP_ROOT_USER_ACTION=ignore
COPY images/requirements.txt /tmp/requirements.txt
COPY images/wheels/ /wheels/
# --system-site-packages: the GPU variant sees the base's CUDA torch; the CPU base has none,
# so the CPU variant installs TORCH_VERSION (in the same resolve: accelerate needs torch).
RUN set -eu; \
    case "$VARIANT" in \
      gpu) torch="" ;; \
      cpu) torch="torch==${TORCH_VERSION}" ;; \
      *) echo "VARIANT must be gpu or cpu, not '$VARIANT'" >&2; exit 1 ;; \
    esac; \
    index=""; if [ "$OFFLINE" = 1 ]; then index="--no-index"; fi; \
    python3 -m venv --system-site-packages /opt/eagle3; \
    /opt/eagle3/bin/pip install $index -r /tmp/requirements.txt $torch; \
    /opt/eagle3/bin/python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# ---- wheel: build the eagle3ctl wheel from the source tree ----
FROM deps AS wheel
COPY pyproject.toml README.md /src/
COPY eagle3/ /src/eagle3/
RUN /opt/eagle3/bin/pip wheel --no-deps --no-build-isolation --wheel-dir /dist /src

# ---- runtime: the base, the deps venv, the wheel; non-root ----
FROM ${BASE_IMAGE} AS runtime
ARG VARIANT=gpu
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="eagle3" \
      org.opencontainers.image.description="eagle3ctl stage image (${VARIANT})" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=deps /opt/eagle3 /opt/eagle3
COPY --from=wheel /dist/ /tmp/dist/
RUN set -eu; \
    /opt/eagle3/bin/pip install --no-deps --no-index --no-cache-dir --disable-pip-version-check /tmp/dist/*.whl; \
    rm -rf /tmp/dist /root/.cache; \
    (getent group 10001 >/dev/null || groupadd --gid 10001 eagle3); \
    useradd --uid 10001 --gid 10001 --create-home --home-dir /home/eagle3 --shell /usr/sbin/nologin eagle3; \
    mkdir -p /work && chown 10001:10001 /work
ENV PATH=/opt/eagle3/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/home/eagle3 \
    HF_HOME=/home/eagle3/.cache/huggingface \
    HF_HUB_DISABLE_TELEMETRY=1 \
    EAGLE3_IMAGE_VARIANT=${VARIANT}
USER 10001:10001
WORKDIR /work
ENTRYPOINT ["eagle3"]
CMD ["--help"]
