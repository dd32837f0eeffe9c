"""The server container's entrypoint when the chart cannot write ``vllm serve`` out directly.

Built-in targets (``builtin:tiny-*``) must be built before any server can load them, and a
CPU-only cluster (kind) serves with ``transformers serve``. This builds/resolves the target
on the model-cache volume and then becomes the server process (exec), listening on 0.0.0.0.
Usage: ``python -m eagle3.k8s.serve -c /etc/eagle3/config.yaml``.
"""

from __future__ import annotations

import argparse
import os
import sys

from eagle3.config import load_config
from eagle3.errors import Eagle3Error


def server_argv(config_path: str) -> tuple[list[str], dict[str, str]]:
    from eagle3.k8s.render import serve_engine
    from eagle3.targets.load import resolve_target

    cfg = load_config(config_path)
    serve = cfg.serve.model_copy(update={"host": "0.0.0.0", "port": cfg.serve.port or 8000})
    if serve_engine(cfg) == "vllm":
        from eagle3.serve.vllm import IMAGE_VLLM, check_vllm_version, vllm_command
        from eagle3.vllm_env import vllm_env

        check_vllm_version()
        argv = vllm_command(serve, cfg.target, resolve_target(cfg.target), IMAGE_VLLM) + list(cfg.kubernetes.vllm_args)
        return argv, vllm_env()
    from eagle3.serve.local import transformers_serve_command

    cmd = transformers_serve_command(cfg.target, serve, device="cpu" if cfg.kubernetes.gpus_per_node == 0 else "auto")
    return cmd.argv, cmd.env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle3.k8s.serve")
    parser.add_argument("-c", "--config", required=True)
    args = parser.parse_args(argv)
    try:
        cmd, env = server_argv(args.config)
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    print("serving: " + " ".join(cmd), file=sys.stderr, flush=True)
    os.execvpe(cmd[0], cmd, {**os.environ, **env})


if __name__ == "__main__":
    main()
