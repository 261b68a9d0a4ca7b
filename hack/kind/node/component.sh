#!/usr/bin/env bash
# Builds one image of the kind node's control plane from a binary, the way kubeadm's
# manifests run it, and saves it: hack/kind/node/component.sh NAME BINARY REF OUT.tar
#   kube-apiserver, kube-controller-manager, kube-scheduler, etcd: FROM scratch, the
#     static binary in /usr/local/bin (kubeadm's static pods name the command)
#   coredns: FROM scratch, ENTRYPOINT /coredns (kubeadm passes only its arguments)
#   kube-proxy, kube-router: the Debian base with iptables, nftables, conntrack and
#     ipset (kube-proxy's proxier and kube-router's firewall run them), the binary in
#     /usr/local/bin
set -euo pipefail
name="$1" binary="$2" ref="$3" out="$4"
ctx="$(mktemp -d)"
trap 'rm -rf "$ctx"' EXIT
cp "$binary" "$ctx/$name"
case "$name" in
  coredns)
    printf 'FROM scratch\nCOPY coredns /coredns\nENTRYPOINT ["/coredns"]\n' >"$ctx/Dockerfile" ;;
  kube-proxy|kube-router)
    printf '%s\n' "ARG BASE_IMAGE" "FROM \${BASE_IMAGE}" \
      "RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iptables nftables conntrack ipset >/dev/null && rm -rf /var/lib/apt/lists/*" \
      "COPY $name /usr/local/bin/$name" >"$ctx/Dockerfile" ;;
  *)
    printf 'FROM scratch\nCOPY %s /usr/local/bin/%s\nENV PATH=/usr/local/bin\n' "$name" "$name" >"$ctx/Dockerfile" ;;
esac
docker build -q --network host --build-arg "BASE_IMAGE=${BASE_IMAGE:-kubeshard.local/debian-python:bookworm}" \
  -t "$ref" "$ctx" >/dev/null
docker save -o "$out" "$ref"
