"""A real S3 wire-protocol server for tests: moto's server in a subprocess.

``moto_s3`` (session) starts ``python -m moto.server`` on a free localhost port, creates
an IAM user with an access key and a bucket, then switches authentication ON, so wrong
credentials are refused as a real S3 would. ``s3_store_uri`` (per test) exports that
key and endpoint as ``AWS_*`` env (inherited by CLI subprocesses) and returns a fresh
``s3://bucket/<prefix>`` URI, so tests never see each other's objects.

Import into ``tests/conftest.py`` with ``from tests.fixtures_s3 import *``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.waiting import until

__all__ = ["MotoS3", "moto_s3", "s3_store_uri"]

_ADMIN_POLICY = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}


@dataclass(frozen=True)
class MotoS3:
    endpoint: str
    bucket: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self, access_key: str | None = None, secret_key: str | None = None) -> Any:
        """A plain boto3 client (for tampering with objects behind the store's back)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            config=Config(request_checksum_calculation="when_required", response_checksum_validation="when_required"),
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(endpoint: str, proc: subprocess.Popen) -> None:
    """Until the server answers, however long its start takes on a loaded machine; an exit is an error."""

    def answers() -> bool:
        try:
            httpx.get(f"{endpoint}/moto-api/", timeout=None)
            return True
        except httpx.HTTPError:
            return False

    if not until(answers, proc):
        raise RuntimeError(f"moto server exited with {proc.returncode}")


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoS3]:
    import boto3

    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        cwd=tmp_path_factory.mktemp("moto"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_up(endpoint, proc)
        # Set-up runs before authentication is switched on (moto counts unauthenticated calls).
        boot = {"endpoint_url": endpoint, "region_name": "us-east-1", "aws_access_key_id": "boot", "aws_secret_access_key": "boot"}
        iam = boto3.client("iam", **boot)
        iam.create_user(UserName="eagle3-test")
        iam.put_user_policy(UserName="eagle3-test", PolicyName="all", PolicyDocument=json.dumps(_ADMIN_POLICY))
        key = iam.create_access_key(UserName="eagle3-test")["AccessKey"]
        bucket = "eagle3-test"
        boto3.client("s3", **boot).create_bucket(Bucket=bucket)
        httpx.post(f"{endpoint}/moto-api/reset-auth", content=b"0").raise_for_status()
        yield MotoS3(endpoint, bucket, key["AccessKeyId"], key["SecretAccessKey"])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def s3_store_uri(moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh ``s3://`` store URI on the moto server, with its credentials in the env."""
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(k, raising=False)
    for k, v in moto_s3.env().items():
        monkeypatch.setenv(k, v)
    return f"s3://{moto_s3.bucket}/t-{uuid.uuid4().hex[:10]}"
