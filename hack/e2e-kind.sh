#!/usr/bin/env bash
# Runs the e2e suite on a kind cluster instead of the local one (`make e2e-kind`).
# Everything is built here, from no registry: Docker (hack/docker.sh), kind
# (hack/node-tools.sh kind), kind's node image (hack/images.sh kindnode: the Kubernetes
# binaries of hack/k8s-tools.sh and the images kubeadm runs) and kubeshard's images with
# the stand-ins the chart and the tests name, loaded into the node from their tarballs.
# Environment:
#   KIND_CLUSTER   cluster name (default kubeshard-e2e); reused if it exists
#   KIND_IMAGE     node image (default: the one hack/images.sh kindnode builds)
#   KEEP_CLUSTER=1 keep the cluster afterwards (default: delete it)
#   PYTEST_ARGS    pytest arguments (default: e2e -m e2e, the whole suite)
#   KIND_IMAGES    the hack/images.sh groups to load (default: standins operator router
#                  shard llamacpp; each costs its size twice in the node: blobs and snapshots)
set -euo pipefail
cd "$(dirname "$0")/.."
. hack/lib.sh  # $cache, etcd_image_tag
start=$SECONDS

name="${KIND_CLUSTER:-kubeshard-e2e}"
k8s_bin="$(hack/k8s-tools.sh | tail -1)"   # kubectl, helm
kind="$(hack/node-tools.sh kind | tail -1)"
export PATH="$k8s_bin:$PATH"
hack/docker.sh up
if [ -z "${KIND_IMAGE:-}" ]; then
  hack/images.sh --load kindnode >/dev/null
  KIND_IMAGE="kubeshard.local/kind-node:$(basename "$(dirname "$k8s_bin")")"
fi
# The project's images, the stand-ins and the llama.cpp server, as tarballs (no Docker
# needed when current).
# shellcheck disable=SC2086  # KIND_IMAGES is a list of groups
mapfile -t tarballs < <(hack/images.sh ${KIND_IMAGES:-standins operator router shard llamacpp})

kubeconfig="$(mktemp)" config="$(mktemp)"
cleanup() {
  [ "${KEEP_CLUSTER:-0}" = 1 ] || "$kind" delete cluster --name "$name" --kubeconfig "$kubeconfig" >/dev/null 2>&1 || true
  rm -f "$kubeconfig" "$config"
}
trap cleanup EXIT
if ! "$kind" get clusters 2>/dev/null | grep -qx "$name"; then
  models="$cache/demo-models"
  mkdir -p "$models"
  sed -e "s|@DEMO_MODELS@|$models|g" -e "s|@ETCD_TAG@|$(etcd_image_tag)|g" hack/kind/cluster.yaml >"$config"
  # --kubeconfig: the cluster's credentials go to a file of its own, not ~/.kube/config
  "$kind" create cluster --name "$name" --image "$KIND_IMAGE" --config "$config" --wait 180s \
    --retain --kubeconfig "$kubeconfig"
fi
"$kind" get kubeconfig --name "$name" >"$kubeconfig"
for t in "${tarballs[@]}"; do
  if ! "$kind" load image-archive "$t" --name "$name"; then
    echo "e2e-kind: loading $t failed; free space where Docker keeps the node:" >&2
    df -h "$(docker info -f '{{.DockerRootDir}}')" >&2
    exit 1
  fi
done
echo "e2e-kind: cluster $name up with the images loaded in $((SECONDS - start)) s" >&2

# shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
KUBESHARD_E2E_KUBECONFIG="$kubeconfig" .venv/bin/python -m pytest ${PYTEST_ARGS:-e2e -m e2e}
