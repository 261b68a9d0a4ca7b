#!/usr/bin/env bash
# Runs the e2e suite on a kind cluster instead of the local process-backed one.
# Needs Docker, kind, kubectl and helm on PATH (it cannot run on the project's own
# machines, which have no container engine). Environment:
#   KIND_CLUSTER   cluster name (default kubeshard-e2e); reused if it exists
#   KIND_IMAGE     node image (default kindest/node:v1.37.2, matching hack/k8s-tools)
#   KEEP_CLUSTER=1 keep the cluster afterwards (default: delete it)
#   PYTEST_ARGS    extra pytest arguments (default: -m e2e)
set -euo pipefail
cd "$(dirname "$0")/.."

name="${KIND_CLUSTER:-kubeshard-e2e}"
image="${KIND_IMAGE:-kindest/node:v1.37.2}"
# The chart's default image names (charts/kubeshard/values.yaml, appVersion), so the
# chart and operator run unchanged.
tag="$(awk -F'"' '/^appVersion:/ {print $2}' charts/kubeshard/Chart.yaml)"
for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null || { echo "e2e-kind: $tool is not installed" >&2; exit 1; }
done

make install
if ! kind get clusters | grep -qx "$name"; then
  kind create cluster --name "$name" --image "$image" --config hack/kind/cluster.yaml --wait 120s
fi
kubeconfig="$(mktemp)"
trap 'rm -f "$kubeconfig"; [ "${KEEP_CLUSTER:-0}" = 1 ] || kind delete cluster --name "$name"' EXIT
kind get kubeconfig --name "$name" >"$kubeconfig"

# Build the images from the repository root and load them into the nodes (kind nodes
# cannot pull from this machine's Docker daemon).
for part in shard_server router operator; do
  repo="ghcr.io/kubeshard/${part//_/-}"
  docker build -t "$repo:$tag" -f "$part/Dockerfile" .
  kind load docker-image "$repo:$tag" --name "$name"
done

KUBESHARD_E2E_KUBECONFIG="$kubeconfig" .venv/bin/python -m pytest e2e ${PYTEST_ARGS:--m e2e}
