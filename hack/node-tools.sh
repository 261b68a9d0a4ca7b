#!/usr/bin/env bash
# Builds (or reuses) what a real node needs besides the Kubernetes binaries of
# hack/k8s-tools.sh, into $KUBESHARD_CACHE/node/bin:
#
#   runc-wrapper   hack/runc-wrapper (Go, no dependencies): runc minus the capabilities
#                  this VM withholds; containerd's and dockerd's runtime binary
#   pause          hack/images/pause.c, static: the sandbox image's only program
#   crictl         sigs.k8s.io/cri-tools, pinned in hack/node-tools/go.mod: the CRI
#                  client that removes the local node's pods on teardown
#   kube-router    github.com/cloudnativelabs/kube-router/v2, pinned in hack/netpol/go.mod:
#                  its network-policy controller (iptables + ipset) enforces
#                  NetworkPolicy on the local node (v2.1.0 is the only release the Go
#                  proxy serves; it runs on this machine's pod network only)
#   kind, coredns  sigs.k8s.io/kind and CoreDNS (hack/kind/coredns: the plugins kubeadm's
#                  Corefile names), pinned in hack/kind/go.mod: for kind's node image,
#                  `make e2e-kind` and `make kind-smoke`, so built when named, not by default
#
# containerd, runc and the CNI plugins are Debian's (hack/ensure-system-deps.sh
# --containers). A stamp per tool (a hash of its sources) decides reuse.
#
# Usage: hack/node-tools.sh [TOOL...]   prints each tool's path (default: the bin folder)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"  # $cache
bin="$cache/node/bin"
mkdir -p "$bin"

stamp_of() { cat "$@" | sha256sum | cut -c1-16; }

build_runc_wrapper() {
  local src="$here/runc-wrapper" stamp
  stamp="$(stamp_of "$src/main.go" "$src/go.mod")"
  if [ -x "$bin/runc-wrapper" ] && [ "$(cat "$bin/runc-wrapper.stamp" 2>/dev/null)" = "$stamp" ]; then return; fi
  local go_bin; go_bin="$(command -v go || echo /usr/local/go/bin/go)"
  (cd "$src" && GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=readonly \
     GOCACHE="$cache/go/build" GOMODCACHE="$cache/go/mod" \
     "$go_bin" build -trimpath -ldflags "-s -w" -o "$bin/runc-wrapper.tmp" .)
  mv "$bin/runc-wrapper.tmp" "$bin/runc-wrapper"
  echo "$stamp" >"$bin/runc-wrapper.stamp"
}

build_pause() {
  local src="$here/images/pause.c" stamp
  stamp="$(stamp_of "$src")"
  if [ -x "$bin/pause" ] && [ "$(cat "$bin/pause.stamp" 2>/dev/null)" = "$stamp" ]; then return; fi
  "${CC:-gcc}" -Os -static -o "$bin/pause.tmp" "$src"
  strip "$bin/pause.tmp" 2>/dev/null || true
  mv "$bin/pause.tmp" "$bin/pause"
  echo "$stamp" >"$bin/pause.stamp"
}

build_crictl() {
  local src="$here/node-tools" stamp
  stamp="$(stamp_of "$src/go.mod" "$src/go.sum")"
  if [ -x "$bin/crictl" ] && [ "$(cat "$bin/crictl.stamp" 2>/dev/null)" = "$stamp" ]; then return; fi
  local go_bin; go_bin="$(command -v go || echo /usr/local/go/bin/go)"
  local version; version="$(awk '{for (i = 1; i < NF; i++) if ($i == "sigs.k8s.io/cri-tools") {print $(i + 1); exit}}' "$src/go.mod")"
  echo "node-tools: building crictl $version" >&2
  (cd "$src" && GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=readonly \
     GOCACHE="$cache/go/build" GOMODCACHE="$cache/go/mod" \
     "$go_bin" build -trimpath -ldflags "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=$version" \
       -o "$bin/crictl.tmp" sigs.k8s.io/cri-tools/cmd/crictl) >&2
  mv "$bin/crictl.tmp" "$bin/crictl"
  echo "$stamp" >"$bin/crictl.stamp"
}

build_kube_router() {
  local src="$here/netpol" stamp
  stamp="$(stamp_of "$src/go.mod" "$src/go.sum")"
  if [ -x "$bin/kube-router" ] && [ "$(cat "$bin/kube-router.stamp" 2>/dev/null)" = "$stamp" ]; then return; fi
  local go_bin; go_bin="$(command -v go || echo /usr/local/go/bin/go)"
  echo "node-tools: building kube-router (about 5 minutes cold)" >&2
  (cd "$src" && GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=readonly \
     GOCACHE="$cache/go/build" GOMODCACHE="$cache/go/mod" \
     "$go_bin" build -trimpath -ldflags "-s -w" -o "$bin/kube-router.tmp" \
       github.com/cloudnativelabs/kube-router/v2/cmd/kube-router) >&2
  mv "$bin/kube-router.tmp" "$bin/kube-router"
  echo "$stamp" >"$bin/kube-router.stamp"
}

build_kind_tool() { # kind | coredns
  local name="$1" src="$here/kind" stamp pkg ldflags="-s -w"
  stamp="$(stamp_of "$src/go.mod" "$src/go.sum" "$src/coredns/main.go")"
  if [ -x "$bin/$name" ] && [ "$(cat "$bin/$name.stamp" 2>/dev/null)" = "$stamp" ]; then return; fi
  local go_bin; go_bin="$(command -v go || echo /usr/local/go/bin/go)"
  case "$name" in
    kind) pkg=sigs.k8s.io/kind ;;
    coredns)
      pkg=./coredns
      local version; version="$(awk '$1 == "github.com/coredns/coredns" {print $2; exit}' "$src/go.mod")"
      ldflags+=" -X github.com/coredns/coredns/coremain.GitCommit=module-$version"
      ;;
  esac
  echo "node-tools: building $name" >&2
  (cd "$src" && GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=readonly \
     GOCACHE="$cache/go/build" GOMODCACHE="$cache/go/mod" \
     "$go_bin" build -trimpath -ldflags "$ldflags" -o "$bin/$name.tmp" "$pkg") >&2
  mv "$bin/$name.tmp" "$bin/$name"
  echo "$stamp" >"$bin/$name.stamp"
}

exec 9>"$bin/.lock"
flock -w 600 9
if [ $# -eq 0 ]; then
  build_runc_wrapper
  build_pause
  build_crictl
  build_kube_router
  echo "$bin"
  exit 0
fi
for tool in "$@"; do
  case "$tool" in
    runc-wrapper) build_runc_wrapper ;;
    pause) build_pause ;;
    crictl) build_crictl ;;
    kube-router) build_kube_router ;;
    kind | coredns) build_kind_tool "$tool" ;;
    *) echo "node-tools: unknown tool $tool" >&2; exit 2 ;;
  esac
  echo "$bin/$tool"
done
