"""``s3://bucket/prefix`` store over boto3 (AWS S3, MinIO, Ceph RGW, R2).

Objects above one part are sent as multipart uploads, hashed as they stream, so
memory stays bounded by the part size whatever the object size.

Faults: every call, the start-up check included, runs under botocore's ``standard`` (or
``adaptive``) retry mode with a budget of attempts and exponential backoff. What botocore
cannot retry is handled here: a body cut mid-stream is resumed with a ranged GET pinned to
the object's ETag; a retried request that had already succeeded (the completion of a
multipart upload, a conditional PUT) is recognised by what it left in the store.
"""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

from eagle3.errors import StoreError
from eagle3.store.base import Copied, HashingWriter, ObjectInfo, ObjectStat, ObjectStore, PartialWrite, validate_key

PART_SIZE = 16 << 20  # S3 minimum is 5 MiB; 16 MiB keeps 10,000 parts ≥ 160 GB objects
COPY_MAX = 5 << 30  # the largest object one CopyObject copies; larger ones are copied part by part
COPY_PART = 1 << 30  # UploadPartCopy part size (10,000 parts: objects up to ~10 TB)
MAX_ATTEMPTS = 10  # per call, the first included
RETRY_MODE = "standard"
_CUT = ("IncompleteReadError", "ReadTimeoutError", "ProtocolError", "ResponseStreamingError",
        "ConnectionClosedError", "ConnectionError", "IncompleteRead", "ChunkedEncodingError")


def _client(endpoint_url: str | None, region: str | None, max_attempts: int, mode: str, connect_timeout: float = 10) -> Any:
    import boto3
    from botocore.config import Config

    cfg = Config(
        # The newer boto3 defaults (CRC checksums on every request) break MinIO.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        retries={"total_max_attempts": max_attempts, "mode": mode},
        connect_timeout=connect_timeout,
        read_timeout=120,
    )
    # A session per store: boto3's module-level default session caches the credentials it
    # first resolved, so a later store (new env, rotated keys) would silently reuse them.
    session = boto3.session.Session()
    return session.client("s3", endpoint_url=endpoint_url, region_name=region or "us-east-1", config=cfg)


def _code(e: Exception) -> str | None:
    from botocore.exceptions import ClientError

    if isinstance(e, ClientError):
        return str(e.response.get("Error", {}).get("Code", "?"))
    return None


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


def _cut(e: BaseException) -> bool:
    """A connection dropped or a body cut short while streaming (botocore does not retry these)."""
    return type(e).__name__ in _CUT or type(e).__module__.split(".")[0] in ("urllib3", "http")


def multipart_etag(part_etags: list[str]) -> str:
    """The ETag S3 gives a completed multipart upload: md5 of the parts' md5s, and their count."""
    digests = b"".join(bytes.fromhex(e.strip('"')) for e in part_etags)
    return f'"{hashlib.md5(digests).hexdigest()}-{len(part_etags)}"'


def _complete_upload(client: Any, bucket: str, key: str, upload_id: str, parts: list[dict[str, Any]]) -> str:
    """Complete a multipart upload; its ETag."""
    want = multipart_etag([p["ETag"] for p in parts])
    try:
        return str(client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id,
                                                    MultipartUpload={"Parts": parts})["ETag"])
    except Exception as e:
        # A retry of a completion that had succeeded (its answer lost) finds no upload: the
        # object is there if it carries the ETag these very parts make.
        if _code(e) not in ("NoSuchUpload", "404"):
            raise
        head = client.head_object(Bucket=bucket, Key=key)
        if head.get("ETag") != want:
            raise
        return want


class _MultipartSink:
    """Buffers writes into parts and uploads each as it fills."""

    def __init__(self, client: Any, bucket: str, key: str) -> None:
        self.client, self.bucket, self.key = client, bucket, key
        self.buf = bytearray()
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []
        self.etag: str | None = None

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
            self.etag = self.client.put_object(Bucket=self.bucket, Key=self.key, Body=bytes(self.buf))["ETag"]
            return
        if self.buf:
            self._send(bytes(self.buf))
        self.etag = _complete_upload(self.client, self.bucket, self.key, self.upload_id, self.parts)
        self.upload_id = None

    def abort(self) -> None:
        if self.upload_id is not None:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)
            except Exception:  # best effort: a lifecycle rule cleans up what this misses
                pass


class _ResumingBody:
    """A GET body that survives a connection cut mid-stream: the rest is fetched with a ranged
    GET pinned to the first response's ETag (so the bytes cannot change underneath)."""

    def __init__(self, store: S3Store, key: str, response: dict[str, Any]) -> None:
        self.store, self.key = store, key
        self.body = response["Body"]
        self.etag = response.get("ETag")
        self.length = int(response.get("ContentLength", -1))
        self.pos = 0
        self.resumes = 0

    def read(self, n: int = -1) -> bytes:
        while True:
            try:
                data = self.body.read() if n is None or n < 0 else self.body.read(n)
            except Exception as e:
                if not _cut(e):
                    raise
                self._resume(e)
                continue
            if not data and 0 <= self.length and self.pos < self.length:
                self._resume(None)  # a short body that ended without an error
                continue
            self.pos += len(data)
            return data

    def _resume(self, cause: BaseException | None) -> None:
        self.resumes += 1
        if self.resumes >= self.store.max_attempts:
            raise StoreError(f"reading {self.store.uri}/{self.key}: the connection was cut {self.resumes} times"
                             + (f" ({type(cause).__name__})" if cause else ""))
        time.sleep(min(0.05 * 2 ** self.resumes, 2.0))
        try:
            self.body.close()
        except Exception:  # noqa: BLE001 - the old connection is gone anyway
            pass
        kwargs: dict[str, Any] = {"Range": f"bytes={self.pos}-"}
        if self.etag:
            kwargs["IfMatch"] = self.etag
        try:
            self.body = self.store.client.get_object(Bucket=self.store.bucket, Key=self.store._k(self.key), **kwargs)["Body"]
        except Exception as e:
            if _code(e) in ("PreconditionFailed", "412"):
                raise StoreError(f"reading {self.store.uri}/{self.key}: the object changed while it was read") from None
            raise _explain(e, f"reading {self.store.uri}/{self.key}") from None

    def close(self) -> None:
        self.body.close()


class S3Store(ObjectStore):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        max_attempts: int = MAX_ATTEMPTS,
        retry_mode: str = RETRY_MODE,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.max_attempts = max_attempts
        self.client = _client(endpoint_url, region, max_attempts, retry_mode)

    def _k(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def check(self) -> None:
        """Fail early, in one line, on bad credentials, endpoint or bucket.

        A one-key listing under the store's prefix: unlike HEAD it returns an error body
        (InvalidAccessKeyId vs NoSuchBucket vs AccessDenied), and it needs only the
        ListBucket permission the stages need anyway (a role may be scoped to the prefix).
        It runs under the same retry budget as every other call: a 503 at start-up is a fault
        to ride out, not a reason to fail the run.
        """
        try:
            self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix + "/" if self.prefix else "", MaxKeys=1)
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
        w.info = ObjectInfo(key, w.size, w.hexdigest(), sink.etag)  # type: ignore[attr-defined]

    @contextmanager
    def reader(self, key: str) -> Iterator[BinaryIO]:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._k(key))
        except Exception as e:
            if _code(e) in ("NoSuchKey", "404"):
                raise StoreError(f"missing object {self.uri}/{key}") from None
            raise _explain(e, f"reading {self.uri}/{key}") from None
        body = _ResumingBody(self, key, response)
        try:
            yield body  # type: ignore[misc]
        except Exception as e:
            if type(e).__module__.split(".")[0] in ("botocore", "urllib3"):
                raise StoreError(f"reading {self.uri}/{key}: {type(e).__name__}: {e}") from None
            raise
        finally:
            body.close()

    def stat(self, key: str) -> ObjectStat | None:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._k(key))
        except Exception as e:
            if _code(e) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise _explain(e, f"stat {self.uri}/{key}") from None
        return ObjectStat(int(head["ContentLength"]), str(head.get("ETag", "")))

    def _list_full(self, prefix: str) -> Iterator[dict[str, Any]]:
        full = self._k(prefix.strip("/")) + "/" if prefix.strip("/") else (self.prefix + "/" if self.prefix else "")
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                yield from page.get("Contents", [])
        except Exception as e:
            raise _explain(e, f"listing {self.uri}/{prefix}") from None

    def _rel(self, full_key: str) -> str:
        return full_key[len(self.prefix) + 1:] if self.prefix else full_key

    def stat_prefix(self, prefix: str) -> dict[str, ObjectStat]:
        """One LIST request per 1,000 objects: size and ETag of every object under the prefix."""
        return {self._rel(o["Key"]): ObjectStat(int(o["Size"]), str(o.get("ETag", ""))) for o in self._list_full(prefix)}

    def list(self, prefix: str) -> list[str]:
        return sorted(self._rel(o["Key"]) for o in self._list_full(prefix))

    def has_prefix(self, prefix: str) -> bool:
        full = self._k(prefix.strip("/")) + "/" if prefix.strip("/") else (self.prefix + "/" if self.prefix else "")
        try:
            return bool(self.client.list_objects_v2(Bucket=self.bucket, Prefix=full, MaxKeys=1).get("Contents"))
        except Exception as e:
            raise _explain(e, f"listing {self.uri}/{prefix}") from None

    def partial_writes(self, prefix: str) -> list[PartialWrite]:
        """Unfinished multipart uploads (one LIST per 1,000), each dated by its newest part."""
        full = self._k(prefix.strip("/")) + "/" if prefix.strip("/") else (self.prefix + "/" if self.prefix else "")
        out = []
        try:
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=full):
                for u in page.get("Uploads", []):
                    written = self._last_part_written(u)
                    if written is not None:
                        out.append(PartialWrite(self._rel(u["Key"]), written, u["UploadId"]))
        except Exception as e:
            raise _explain(e, f"listing unfinished uploads under {self.uri}/{prefix}") from None
        return out

    def _last_part_written(self, upload: dict[str, Any]) -> float | None:
        """When the upload last grew (None: it finished or was aborted meanwhile)."""
        newest = upload["Initiated"]
        try:
            pages = self.client.get_paginator("list_parts").paginate(Bucket=self.bucket, Key=upload["Key"],
                                                                    UploadId=upload["UploadId"])
            for page in pages:
                newest = max([newest, *(p["LastModified"] for p in page.get("Parts", []))])
        except Exception as e:
            if _code(e) in ("NoSuchUpload", "404"):
                return None
            raise
        return newest.timestamp()

    def remove_partial(self, partial: PartialWrite) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=self._k(partial.key), UploadId=partial.handle)
        except Exception as e:
            if _code(e) not in ("NoSuchUpload", "404"):
                raise _explain(e, f"aborting the upload of {self.uri}/{partial.key}") from None

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._k(key))
        except Exception as e:
            raise _explain(e, f"deleting {self.uri}/{key}") from None

    def delete_many(self, keys: list[str]) -> int:
        """Batch deletes (1,000 keys a request): wiping thousands of shards stays quick."""
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._k(k)} for k in keys[i : i + 1000]]
            try:
                r = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            except Exception as e:
                raise _explain(e, f"deleting {self.uri}/{keys[i]} and {len(batch) - 1} more") from None
            if r.get("Errors"):
                err = r["Errors"][0]
                raise StoreError(f"deleting {self.uri}/{err.get('Key')}: S3 error {err.get('Code')} {err.get('Message', '')}".strip())
        return len(keys)

    def copy(self, src: str, dst: str, if_fingerprint: str | None = None) -> Copied:
        """A server-side copy (CopyObject; UploadPartCopy above COPY_MAX): no byte passes through
        here, and each request is conditional on the source's ETag, so a source rewritten while
        it is copied is refused, never half-copied."""
        st = self.copy_source(src, if_fingerprint)
        source = {"Bucket": self.bucket, "Key": self._k(src)}
        try:
            if st.size <= COPY_MAX:
                self.client.copy_object(Bucket=self.bucket, Key=self._k(dst), CopySource=source,
                                        CopySourceIfMatch=st.fingerprint)
            else:
                self._copy_parts(source, dst, st)
        except Exception as e:  # noqa: BLE001 - botocore's errors become one line below
            code = _code(e)
            if code in ("PreconditionFailed", "412"):
                raise StoreError(f"{self.uri}/{src} changed while it was copied; not copied") from None
            if code in ("NoSuchKey", "404"):
                raise StoreError(f"missing object {self.uri}/{src}") from None
            raise _explain(e, f"copying {self.uri}/{src} to {dst}") from None
        copied = self.stat(dst)
        if copied is None or copied.size != st.size:
            raise StoreError(f"copying {self.uri}/{src}: {dst} holds {copied.size if copied else 'nothing'}, "
                             f"expected {st.size} bytes")
        return Copied(copied, st.fingerprint)

    def _copy_parts(self, source: dict[str, str], dst: str, st: ObjectStat) -> None:
        key = self._k(dst)
        upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        try:
            parts = []
            for n, start in enumerate(range(0, st.size, COPY_PART), 1):
                end = min(start + COPY_PART, st.size) - 1
                r = self.client.upload_part_copy(Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=n,
                                                 CopySource=source, CopySourceRange=f"bytes={start}-{end}",
                                                 CopySourceIfMatch=st.fingerprint)
                parts.append({"PartNumber": n, "ETag": r["CopyPartResult"]["ETag"]})
            _complete_upload(self.client, self.bucket, key, upload_id, parts)
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            except Exception:  # noqa: BLE001, S110 - best effort: a lifecycle rule cleans up what this misses
                pass
            raise

    def get_bytes(self, key: str) -> bytes:
        buf = io.BytesIO()
        with self.reader(key) as r:
            while chunk := r.read(1 << 20):
                buf.write(chunk)
        return buf.getvalue()

    # -- conditional writes (S3 conditional requests: If-None-Match / If-Match on PUT and DELETE)

    def _ours_after_412(self, key: str, data: bytes) -> str | None:
        """A conditional PUT answered 412 may be the retry of our own PUT that succeeded (its
        answer lost to a fault): then the object holds exactly our bytes (callers put a unique
        owner token in them), and its ETag is the new version."""
        current = self.get_versioned(key)
        return current[1] if current is not None and current[0] == data else None

    def create_exclusive(self, key: str, data: bytes) -> str | None:
        try:
            return str(self.client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data, IfNoneMatch="*")["ETag"])
        except Exception as e:
            if _code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return self._ours_after_412(key, data)
            raise _explain(e, f"creating {self.uri}/{key}") from None

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._k(key))
        except Exception as e:
            if _code(e) in ("NoSuchKey", "404"):
                return None
            raise _explain(e, f"reading {self.uri}/{key}") from None
        body = _ResumingBody(self, key, response)
        try:
            data = body.read()
        finally:
            body.close()
        return data, str(response.get("ETag", ""))

    def replace_if(self, key: str, data: bytes, version: str) -> str | None:
        try:
            return str(self.client.put_object(Bucket=self.bucket, Key=self._k(key), Body=data, IfMatch=version)["ETag"])
        except Exception as e:
            if _code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409", "NoSuchKey", "404"):
                return self._ours_after_412(key, data)
            raise _explain(e, f"replacing {self.uri}/{key}") from None

    def delete_if(self, key: str, version: str) -> bool:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._k(key), IfMatch=version)
            return True
        except Exception as e:
            code = _code(e)
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return False
            if code in ("NoSuchKey", "404"):
                return True  # gone (a retry of our own delete, its answer lost)
            if code in ("NotImplemented", "501"):  # a store without conditional deletes
                current = self.get_versioned(key)
                if current is None:
                    return True
                if current[1] != version:
                    return False
                self.delete(key)
                return True
            raise _explain(e, f"deleting {self.uri}/{key}") from None
