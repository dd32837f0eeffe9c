"""Object stores: ``file://`` (the embedded default) and ``s3://`` (boto3).

Every write goes through a :class:`HashingWriter`, so size and sha256 are known the
moment an object is committed; an object is visible only once complete (rename on
local disk, single PUT or completed multipart upload on S3).
"""

from __future__ import annotations

from eagle3.store.base import (Copied, ObjectInfo, ObjectStat, ObjectStore, PartialWrite, local_copy,
                               stale_partial_writes, validate_key)
from eagle3.store.open import open_store

__all__ = ["Copied", "ObjectInfo", "ObjectStat", "ObjectStore", "PartialWrite", "local_copy", "open_store",
           "stale_partial_writes", "validate_key"]
