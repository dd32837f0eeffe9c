"""``s3://bucket/prefix`` store over boto3 (AWS S3, MinIO, Ceph RGW, R2).

Objects above one part are sent as multipart uploads, hashed as they stream, so
memory stays bounded by the part size whatever the object size.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

from eagle3.errors import StoreError
from eagle3.store.base import HashingWriter, ObjectInfo, ObjectStore, validate_key

PART_SIZE = 16 << 20  # S3 minimum is 5 MiB; 16 MiB keeps 10,000 parts ≥ 160 GB objects


def _client(endpoint_url: str | None, region: str | None, max_attempts: int, connect_timeout: float = 10) -> Any:
    import boto3
    from botocore.config import Config

    cfg = Config(
        # The newer boto3 defaults (CRC checksums on every request) break MinIO.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        retries={"max_attempts": max_attempts, "mode": "adaptive"},
        connect_timeout=connect_timeout,
        read_timeout=120,
    )
    # A session per store: boto3's module-level default session caches the credentials it
    # first resolved, so a later store (new env, rotated keys) would silently reuse them.
    session = boto3.session.Session()
    return session.client("s3", endpoint_url=endpoint_url, region_name=region or "us-east-1", config=cfg)


def _explain(e: Exception, what: str) -> StoreError:
    """Turn a botocore exception into one line naming the cause."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    if isinstance(e, NoCredentialsError):
        return StoreError(f"{what}: no S3 credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)")
    if isinstance(e, EndpointConnectionError):
        return StoreError(f"{what}: cannot reach S3 endpoint ({e})")
    if isinstance(e, ClientError):
        code = e.response.get("Error", {}).get("Code", "?")
        msg = e.response.get("Error", {}).get("Message", "")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"):
            return StoreError(f"{what}: S3 refused the credentials ({code})")
        if code == "NoSuchBucket":
            bucket = e.response.get("Error", {}).get("BucketName")
            return StoreError(f"{what}: bucket {bucket + ' ' if bucket else ''}does not exist")
        return StoreError(f"{what}: S3 error {code} {msg}".strip())
    return StoreError(f"{what}: {type(e).__name__}: {e}")


class _MultipartSink:
    """Buffers writes into parts and uploads each as it fills."""

    def __init__(self, client: Any, bucket: str, key: str) -> None:
        self.client, self.bucket, self.key = client, bucket, key
        self.buf = bytearray()
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []

    def write(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= PART_SIZE:
            self._send(bytes(self.buf[:PART_SIZE]))
            del self.buf[:PART_SIZE]

    def _send(self, body: bytes) -> None:
        if self.upload_id is None:
            self.upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=self.key)["UploadId"]
        n = len(self.parts) + 1
        r = self.client.upload_part(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id, PartNumber=n, Body=body)
        self.parts.append({"PartNumber": n, "ETag": r["ETag"]})

    def finish(self) -> None:
        if self.upload_id is None:  # small object: one PUT
            self.client.put_object(Bucket=self.bucket, Key=self.key, Body=bytes(self.buf))
            return
        if self.buf:
            self._send(bytes(self.buf))
        self.client.complete_multipart_upload(
            Bucket=self.bucket, Key=self.key, UploadId=self.upload_id, MultipartUpload={"Parts": self.parts}
        )

    def abort(self) -> None:
        if self.upload_id is not None:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)
            except Exception:  # best effort: a lifecycle rule cleans up what this misses
                pass


class S3Store(ObjectStore):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        max_attempts: int = 8,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.client = _client(endpoint_url, region, max_attempts)
        self._client_args = (endpoint_url, region)

    def _k(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def check(self) -> None:
        """Fail early, in one line, on bad credentials, endpoint or bucket.

        A one-key listing under the store's prefix: unlike HEAD it returns an error body
        (InvalidAccessKeyId vs NoSuchBucket vs AccessDenied), and it needs only the
        ListBucket permission the stages need anyway (a role may be scoped to the prefix).
        """
        # Few attempts: a wrong endpoint should be one line in seconds, not after a minute
        # of backoff; the stage's own calls keep the full adaptive retries.
        quick = _client(*self._client_args, max_attempts=2, connect_timeout=5)
        try:
            quick.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix + "/" if self.prefix else "", MaxKeys=1)
        except Exception as e:
            raise _explain(e, f"store {self.uri}") from None

    @contextmanager
    def writer(self, key: str) -> Iterator[HashingWriter]:
        sink = _MultipartSink(self.client, self.bucket, self._k(key))
        w = HashingWriter(sink)  # type: ignore[arg-type]
        try:
            yield w
            sink.finish()
        except BaseException as e:  # also on Ctrl-C / generator close: never leave a dangling upload
            sink.abort()
            if type(e).__module__.startswith("botocore"):
                raise _explain(e, f"writing {self.uri}/{key}") from None
            raise
        w.info = ObjectInfo(key, w.size, w.hexdigest())  # type: ignore[attr-defined]

    @contextmanager
    def reader(self, key: str) -> Iterator[BinaryIO]:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._k(key))["Body"]
        except Exception as e:
            from botocore.exceptions import ClientError

            if isinstance(e, ClientError) and e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise StoreError(f"missing object {self.uri}/{key}") from None
            raise _explain(e, f"reading {self.uri}/{key}") from None
        try:
            yield body  # type: ignore[misc]
        except Exception as e:
            # A connection dropped mid-stream or a short body surfaces from body.read().
            if type(e).__module__.split(".")[0] in ("botocore", "urllib3"):
                raise StoreError(f"reading {self.uri}/{key}: {type(e).__name__}: {e}") from None
            raise
        finally:
            body.close()

    def size(self, key: str) -> int | None:
        from botocore.exceptions import ClientError

        try:
            return int(self.client.head_object(Bucket=self.bucket, Key=self._k(key))["ContentLength"])
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise _explain(e, f"stat {self.uri}/{key}") from None
        except Exception as e:
            raise _explain(e, f"stat {self.uri}/{key}") from None

    def list(self, prefix: str) -> list[str]:
        full = self._k(prefix.strip("/")) + "/" if prefix.strip("/") else (self.prefix + "/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys: list[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                keys.extend(o["Key"][strip:] for o in page.get("Contents", []))
        except Exception as e:
            raise _explain(e, f"listing {self.uri}/{prefix}") from None
        return sorted(keys)

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._k(key))
        except Exception as e:
            raise _explain(e, f"deleting {self.uri}/{key}") from None

    def delete_prefix(self, prefix: str) -> int:
        """Batch deletes (1,000 keys a request): wiping thousands of shards stays quick."""
        keys = self.list(prefix)
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._k(k)} for k in keys[i : i + 1000]]
            try:
                r = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            except Exception as e:
                raise _explain(e, f"deleting under {self.uri}/{prefix}") from None
            if r.get("Errors"):
                err = r["Errors"][0]
                raise StoreError(f"deleting {self.uri}/{err.get('Key')}: S3 error {err.get('Code')} {err.get('Message', '')}".strip())
        return len(keys)

    def get_bytes(self, key: str) -> bytes:
        buf = io.BytesIO()
        with self.reader(key) as r:
            while chunk := r.read(1 << 20):
                buf.write(chunk)
        return buf.getvalue()
