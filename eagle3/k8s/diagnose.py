"""Why a stage's pods are stuck or failed, as one line (pure functions over API dicts)."""

from __future__ import annotations

# Waiting reasons that never resolve by waiting: the stage fails at once with them.
FATAL_WAITING = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError",
                 "CreateContainerError", "CrashLoopBackOff", "ErrImageNeverPull")


def _statuses(pod: dict) -> list[dict]:
    st = pod.get("status", {})
    return st.get("initContainerStatuses", []) + st.get("containerStatuses", [])


def scheduling_message(pod: dict, events: list[dict]) -> str | None:
    """The latest FailedScheduling message of an unschedulable pod, else its condition's message."""
    name = pod["metadata"]["name"]
    mine = [e for e in events if e.get("involvedObject", {}).get("name") == name and e.get("reason") == "FailedScheduling"]
    if mine:
        latest = max(mine, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or e["metadata"].get("creationTimestamp") or "")
        return " ".join(latest.get("message", "").split())
    for c in pod.get("status", {}).get("conditions", []):
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return " ".join((c.get("message") or c.get("reason") or "unschedulable").split())
    return None


def pod_problem(pod: dict, events: list[dict]) -> tuple[str, bool] | None:
    """(one line, fatal) for a pod in trouble, or None. Pending is not fatal by itself."""
    name = pod["metadata"]["name"]
    for cs in _statuses(pod):
        waiting = cs.get("state", {}).get("waiting") or {}
        if waiting.get("reason") in FATAL_WAITING:
            msg = " ".join((waiting.get("message") or "").split())
            if waiting["reason"] == "CrashLoopBackOff":
                last = cs.get("lastState", {}).get("terminated") or {}
                msg = terminated_line(last) if last else msg
            return f"{waiting['reason']}: pod {name}: {msg or cs.get('image', '')}".rstrip(": "), True
    for cs in _statuses(pod):
        term = cs.get("state", {}).get("terminated")
        if term and term.get("exitCode", 0) != 0:
            return f"{terminated_line(term)} (pod {name})", False
    if pod.get("status", {}).get("phase") == "Pending":
        msg = scheduling_message(pod, events)
        if msg:
            return f"Pending: {msg}", False
    return None


def terminated_line(term: dict) -> str:
    if term.get("reason") == "OOMKilled":
        return f"OOMKilled (exit code {term.get('exitCode', 137)}): the container ran out of its memory limit"
    code = term.get("exitCode")
    detail = " ".join((term.get("message") or "").split())
    return f"exit code {code}" + (f": {detail}" if detail else "")


def job_failure(job: dict) -> str | None:
    """The Failed condition's reason and message, if the Job failed."""
    for c in job.get("status", {}).get("conditions", []):
        if c.get("type") == "Failed" and c.get("status") == "True":
            return f"{c.get('reason', 'Failed')}: {' '.join((c.get('message') or '').split())}".rstrip(": ")
    return None


def job_complete(job: dict) -> bool:
    """A Job's Complete condition, or a JobSet's Completed one (JobSet names it differently)."""
    return any(c.get("type") in ("Complete", "Completed") and c.get("status") == "True"
               for c in job.get("status", {}).get("conditions", []))


def pod_scheduled(pod: dict) -> bool:
    """Placed on a node (its containers may still be pulling or loading)."""
    st = pod.get("status", {})
    if st.get("containerStatuses") or st.get("phase") not in (None, "Pending"):
        return True
    return any(c.get("type") == "PodScheduled" and c.get("status") == "True" for c in st.get("conditions", []))


def pod_ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in pod.get("status", {}).get("conditions", []))


def newest(pods: list[dict]) -> dict | None:
    return max(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "", default=None)
