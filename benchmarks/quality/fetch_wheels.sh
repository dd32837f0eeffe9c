#!/usr/bin/env bash
# The wheels the H200 image lacks for the quality benchmark (speculators and what it and the
# eagle3 package import), pinned, into .whl/ (git-ignored; carry [".whl"]). cp312 manylinux,
# as the device README says; the image's own torch, transformers, pyarrow, ... are used.
# openai stays on 2.x: 3.x needs httpx2, which the image lacks.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.7.0 \
  loguru==0.7.3 openai==2.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 \
  pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
ls .whl | wc -l
