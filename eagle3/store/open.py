"""Open a store from its URI."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from eagle3.errors import StoreError
from eagle3.store.base import ObjectStore


def open_store(uri: str, endpoint_url: str | None = None, region: str | None = None,
               max_attempts: int | None = None, retry_mode: str | None = None) -> ObjectStore:
    """``file:///abs/path``, ``file://rel/path``, a plain path, or ``s3://bucket[/prefix]``.

    For S3 the endpoint comes from the argument, else ``AWS_ENDPOINT_URL``; credentials
    come from boto3's usual chain (env, shared files, IRSA), never from the config file.
    """
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        raw = uri[len("file://"):] if uri.startswith("file://") else uri
        if not raw:
            raise StoreError(f"invalid store URI {uri!r}: empty path")
        from eagle3.store.local import LocalStore

        return LocalStore(Path(raw))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise StoreError(f"invalid store URI {uri!r}: expected s3://bucket[/prefix]")
        from eagle3.store.s3 import S3Store

        return S3Store(
            parsed.netloc,
            parsed.path,
            endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None,
            region=region or os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION"),
            **({"max_attempts": max_attempts} if max_attempts else {}),
            **({"retry_mode": retry_mode} if retry_mode else {}),
        )
    raise StoreError(f"invalid store URI {uri!r}: scheme must be file:// or s3://")
