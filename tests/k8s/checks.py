"""Shared assertions over rendered objects: strict schema validation and pod conventions."""

from __future__ import annotations

import kubernetes_validate
from kubernetes_validate.utils import latest_version

K8S_VERSIONS = ("1.30.0", latest_version())


def validate_strict(objects: list[dict]) -> None:
    """Every built-in object against the official schemas (strict: unknown fields fail)."""
    for obj in objects:
        if obj["kind"] == "JobSet":
            continue  # a CRD: not in the built-in schemas; checked structurally by its own test
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def pod_specs(objects: list[dict]) -> list[tuple[str, dict]]:
    out = []
    for o in objects:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in ("Job", "Deployment"):
            out.append((name, o["spec"]["template"]["spec"]))
        elif o["kind"] == "Pod":
            out.append((name, o["spec"]))
        elif o["kind"] == "JobSet":
            for rj in o["spec"]["replicatedJobs"]:
                out.append((name, rj["template"]["spec"]["template"]["spec"]))
    return out


def by_name(objects: list[dict], kind: str, suffix: str) -> dict:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix))
