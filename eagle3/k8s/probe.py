"""The server's startup and readiness probe: GET /v1/models with the API key, exit 0 when it answers.

An httpGet probe could carry the key only as a literal header in the manifest; this exec probe
reads it from the container's own environment (VLLM_API_KEY, from the Secret). /v1/models, not
/health: it answers only once the weights are loaded.
Usage: ``python3 -m eagle3.k8s.probe --port 8000``.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request

API_KEY_ENV = "VLLM_API_KEY"


def probe(port: int, timeout_s: float = 4.0, host: str = "127.0.0.1") -> str | None:
    """None when the server lists its models; else why not, in one line."""
    request = urllib.request.Request(f"http://{host}:{port}/v1/models")
    key = os.environ.get(API_KEY_ENV)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            resp.read()
    except urllib.error.HTTPError as e:
        return f"/v1/models answered HTTP {e.code}"
    except (OSError, ValueError) as e:
        return f"/v1/models: {getattr(e, 'reason', e)}"
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python3 -m eagle3.k8s.probe")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=4.0)
    args = parser.parse_args(argv)
    problem = probe(args.port, args.timeout)
    if problem:
        print(problem, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
