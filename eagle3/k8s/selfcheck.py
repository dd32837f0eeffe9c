"""``helm test``'s check, run inside the namespace: the store answers and the API allows a run.

Writes, reads back and deletes a probe object under ``<run_id>/.selfcheck/`` with the pod's
own credentials (Secret references), then asks the API server (SelfSubjectAccessReview)
whether this ServiceAccount may make every call eagle3ctl makes during a run
(``eagle3.k8s.permissions``, the list the Role is rendered from). One line per check;
exit 1 if any failed. Usage: ``python -m eagle3.k8s.selfcheck -c /etc/eagle3/config.yaml``.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import Any

from eagle3.config import PipelineConfig, load_config
from eagle3.errors import Eagle3Error



def check_store(cfg: PipelineConfig) -> str:
    from eagle3.store import open_store

    store = open_store(cfg.store.uri, cfg.store.endpoint_url, cfg.store.region)
    key = f"{cfg.run_id}/.selfcheck/{uuid.uuid4().hex}"
    payload = b"eagle3 selfcheck"
    store.put_bytes(key, payload)
    try:
        if store.get_bytes(key) != payload:
            raise Eagle3Error(f"store {cfg.store.uri}: read back a different probe object {key}")
    finally:
        store.delete(key)
    return f"store {cfg.store.uri}: write, read and delete work"


def check_api(cfg: PipelineConfig, kube: Any = None) -> str:
    """Every call of a run allowed? One SelfSubjectAccessReview per (verb, resource)."""
    from eagle3.k8s.kube import KubeClient
    from eagle3.k8s.permissions import run_calls

    kube = kube or KubeClient.connect(namespace=cfg.kubernetes.namespace)
    calls = run_calls(cfg.kubernetes.multi_node == "jobset")
    asked = sorted({(c.verb, c.group, c.resource) for c in calls})
    denied = [f"{verb} {res}" + (f".{group}" if group else "") for verb, group, res in asked if not kube.can_i(verb, group, res)]
    if denied:
        raise Eagle3Error(f"namespace {kube.namespace}: the ServiceAccount may not " + ", ".join(denied))
    return f"api: the ServiceAccount may make all {len(asked)} calls of a run in namespace {kube.namespace}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle3.k8s.selfcheck")
    parser.add_argument("-c", "--config", required=True)
    args = parser.parse_args(argv)
    failed = False
    try:
        cfg = load_config(args.config)
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    for check in (lambda: check_store(cfg), lambda: check_api(cfg)):
        try:
            print(f"ok: {check()}")
        except Eagle3Error as e:
            failed = True
            print(f"failed: {e}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
