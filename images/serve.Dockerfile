# The serve image: vLLM (the server) plus eagle3 (the generate client and the server
# launcher `python -m eagle3.k8s.serve`), so the endpoint and its client share one image.
#
#   docker build -f images/serve.Dockerfile -t REGISTRY/eagle3-serve:TAG .
#
# vLLM's own stack (torch, transformers, numpy, ...) is kept exactly as the vLLM image
# pins it; eagle3's other dependencies are installed at the versions of
# images/requirements.txt. The vLLM entrypoint (`vllm serve`) is kept; the client runs
# with `--entrypoint eagle3` (Kubernetes sets `command:` explicitly).

ARG VLLM_IMAGE=vllm/vllm-openai:v0.34.0

# ---- wheel: build the eagle3ctl wheel ----
FROM ${VLLM_IMAGE} AS wheel
COPY pyproject.toml README.md /src/
COPY eagle3/ /src/eagle3/
# Recent vLLM images install with uv; older ones carry pip.
RUN if command -v uv >/dev/null; then uv build --wheel --out-dir /dist /src; \
    else python3 -m pip wheel --no-deps --no-cache-dir --wheel-dir /dist /src; fi

# ---- runtime ----
FROM ${VLLM_IMAGE} AS runtime
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="eagle3-serve" \
      org.opencontainers.image.description="vLLM with the eagle3 generate client" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY images/requirements.txt images/serve_constraints.py /tmp/
COPY --from=wheel /dist/ /tmp/dist/
# Constrain only what the vLLM image does not already hold, so vLLM's pins stay in force.
RUN python3 /tmp/serve_constraints.py /tmp/requirements.txt > /tmp/constraints.txt
RUN set -eu; \
    if command -v uv >/dev/null; then uv pip install --system --no-cache -c /tmp/constraints.txt /tmp/dist/*.whl; \
    else python3 -m pip install --no-cache-dir --disable-pip-version-check -c /tmp/constraints.txt /tmp/dist/*.whl; fi; \
    python3 -c "import vllm, eagle3.cli.app, eagle3.generate.client, eagle3.k8s.serve, eagle3.extract.vllm_engine, eagle3.extract.vllm_plugin; print('vllm', vllm.__version__)"; \
    rm -rf /tmp/dist /tmp/constraints.txt /tmp/requirements.txt /tmp/serve_constraints.py /root/.cache; \
    (getent group 10001 >/dev/null || groupadd --gid 10001 eagle3); \
    useradd --uid 10001 --gid 10001 --create-home --home-dir /home/eagle3 --shell /usr/sbin/nologin eagle3; \
    mkdir -p /work && chown 10001:10001 /work
ENV HOME=/home/eagle3 \
    HF_HOME=/home/eagle3/.cache/huggingface \
    HF_HUB_DISABLE_TELEMETRY=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /work
