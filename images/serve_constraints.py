"""Print the lines of a requirements lock whose distributions are NOT installed here.

The serve image uses this as pip's constraints: eagle3's own dependencies get the locked
versions, while everything the vLLM base image already holds keeps vLLM's versions.
Usage: python3 serve_constraints.py images/requirements.txt > constraints.txt
"""

import sys
from importlib import metadata

from packaging.utils import canonicalize_name


def main(lock_path: str) -> None:
    have = {canonicalize_name(d.metadata["Name"]) for d in metadata.distributions()}
    with open(lock_path) as lock:
        for line in lock:
            line = line.strip()
            if line and not line.startswith("#") and canonicalize_name(line.split("==")[0]) not in have:
                print(line)


if __name__ == "__main__":
    main(sys.argv[1])
