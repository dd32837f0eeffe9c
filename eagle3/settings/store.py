"""Settings of the object store every stage reads and writes."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_STORE_URI = "file://./eagle3-store"


class StoreSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    uri: str = Field(DEFAULT_STORE_URI, description="file://PATH (embedded default) or s3://BUCKET[/PREFIX].")
    endpoint_url: str | None = Field(None, description="S3 endpoint for MinIO / Ceph / R2; default AWS (or AWS_ENDPOINT_URL).")
    region: str | None = Field(None, description="S3 region.")
    max_attempts: int = Field(10, ge=1, le=100, description="S3: attempts per call, the first included (botocore retries with backoff).")
    retry_mode: str = Field("standard", pattern="^(standard|adaptive)$",
                            description="S3: botocore retry mode; adaptive also slows the client down when throttled.")

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        if not (v.startswith("file://") or v.startswith("s3://")):
            raise ValueError("must start with file:// or s3://")
        if v.startswith("s3://") and not v[5:].split("/")[0]:
            raise ValueError("s3:// URI needs a bucket: s3://BUCKET[/PREFIX]")
        return v

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^/\s]+", v):
            raise ValueError("must be an http(s):// URL")
        return v
