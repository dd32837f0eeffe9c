"""Configs for rendering: a production-like run on S3 with credentials from Secrets."""

from __future__ import annotations

import pytest

from eagle3.config import load_config

SECRET_VALUES = {
    "AWS_ACCESS_KEY_ID": "AKIAFAKEKEYFORTEST01",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMIfakeSecretValueForTest0000",
    "HF_TOKEN": "hf_fakeTokenValueForTest0123456789",
}


@pytest.fixture
def prod_cfg(tmp_path, monkeypatch):
    """A production run: S3 store, HF and S3 Secrets named, GPU scheduling constraints set."""
    for k, v in SECRET_VALUES.items():  # present in the environment: must never be rendered
        monkeypatch.setenv(k, v)
    path = tmp_path / "run.yaml"
    path.write_text("""
run_id: prod-1
backend: kubernetes
store: {uri: s3://drafters/eagle3, endpoint_url: http://minio.storage.svc:9000}
target: {model: moonshotai/Kimi-K2.5, trust_remote_code: true}
serve: {tensor_parallel_size: 8, reasoning_parser: kimi_k2, max_model_len: 32768}
kubernetes:
  namespace: ml
  gpus_per_node: 8
  s3_secret: eagle3-s3
  hf_secret: eagle3-hf
  node_selector: {nvidia.com/gpu.product: NVIDIA-H200}
  tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
  priority_class: eagle3-batch
  runtime_class: nvidia
  image_pull_secrets: [ghcr]
""")
    return load_config(path)
