"""``python -m eagle3 stage NAME`` is the same entrypoint as ``eagle3 stage NAME``."""

from eagle3.cli.stage import main

main()
