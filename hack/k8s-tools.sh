#!/usr/bin/env bash
# Builds (or reuses) the pinned Kubernetes control-plane binaries, etcd and helm from the
# Go module proxy, as pinned by hack/k8s-tools/go.mod:
#
#   kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubelet kubectl
#   kubeadm (kind's node image, `make e2e-kind`)                               (k8s.io/kubernetes)
#   etcd                                                                       (go.etcd.io/etcd/server/v3)
#   helm                                                                       (helm.sh/helm/v3)
#
# into $KUBESHARD_CACHE/k8s/<kubernetes version>/bin (default ~/.cache/kubeshard), outside
# the clone, so a fresh clone or CI run on the same machine reuses them. A stamp file
# holds a hash of the pins; when go.mod/go.sum change the binaries are rebuilt. The Go
# module and build caches live under $KUBESHARD_CACHE/go, so deleting $KUBESHARD_CACHE
# rebuilds from scratch (about 7 minutes on two cores, see bench/results/k8s-control-plane.md).
#
# Prints the bin folder on stdout as its last line. Needs Go >= the go line of go.mod.
# Without Go: put the official release binaries of exactly these versions into that folder
# and write the stamp yourself (see README, "Local Kubernetes control plane").
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
mod_dir="$here/k8s-tools"
cache="${KUBESHARD_CACHE:-$HOME/.cache/kubeshard}"

version_of() { # module path -> pinned version, read from go.mod (no Go needed)
  awk -v m="$1" '$1 == m && $2 ~ /^v/ { print $2; exit }' "$mod_dir/go.mod"
}
k8s_version="$(version_of k8s.io/kubernetes)"
etcd_version="$(version_of go.etcd.io/etcd/server/v3)"
helm_version="$(version_of helm.sh/helm/v3)"
if [ -z "$k8s_version" ] || [ -z "$etcd_version" ] || [ -z "$helm_version" ]; then
  echo "k8s-tools: cannot read the pinned versions from $mod_dir/go.mod" >&2
  exit 1
fi

dest="$cache/k8s/$k8s_version"
bin="$dest/bin"
tools=(kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubelet kubectl kubeadm etcd helm)
stamp_value="$(cat "$mod_dir/go.mod" "$mod_dir/go.sum" "$0" | sha256sum | cut -c1-16)"

is_current() {
  [ -f "$dest/stamp" ] && [ "$(cat "$dest/stamp")" = "$stamp_value" ] || return 1
  for t in "${tools[@]}"; do [ -x "$bin/$t" ] || return 1; done
}

if is_current; then
  echo "$bin"
  exit 0
fi

go_bin="$(command -v go || true)"
if [ -z "$go_bin" ] && [ -x /usr/local/go/bin/go ]; then go_bin=/usr/local/go/bin/go; fi
if [ -z "$go_bin" ]; then
  echo "k8s-tools: Go is not installed; install Go (see the go line of $mod_dir/go.mod)" \
       "or place the release binaries of kubernetes $k8s_version, etcd $etcd_version and" \
       "helm $helm_version in $bin (see README)" >&2
  exit 1
fi

mkdir -p "$cache/k8s"
# Two `make test` runs at once (several engineers, one machine) must not build twice on
# two cores: the second waits for the first, then finds the binaries current.
exec 9>"$cache/k8s/.lock"
if ! flock -w 3600 9; then
  echo "k8s-tools: timed out after 1 h waiting for another build (lock $cache/k8s/.lock)" >&2
  exit 1
fi
if is_current; then
  echo "$bin"
  exit 0
fi

export GOMODCACHE="$cache/go/mod" GOCACHE="$cache/go/build"
# go.sum is complete: readonly fails loudly instead of resolving anything anew.
export GOFLAGS="-mod=readonly" GOTOOLCHAIN=local CGO_ENABLED=0
# Module dates stand in for build dates, so the same pins give the same binaries.
build_date="2026-10-27T12:01:04Z"
minor="${k8s_version#v1.}"; minor="${minor%%.*}"
k8s_ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  k8s_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
  k8s_ldflags+=" -X $pkg.gitCommit=module-$k8s_version"
done
helm_ldflags="-X helm.sh/helm/v3/internal/version.version=$helm_version"
helm_ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
helm_ldflags+=" -X helm.sh/helm/v3/internal/version.gitCommit=module-$helm_version"
# helm's default .Capabilities.KubeVersion (used by `helm template`/lint) follows ours.
for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
  helm_ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$minor"
done
etcd_ldflags="-X go.etcd.io/etcd/api/v3/version.GitSHA=module-$etcd_version"

tmp="$dest/bin.tmp.$$"
rm -rf "$tmp"
mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
echo "k8s-tools: building kubernetes $k8s_version, etcd $etcd_version, helm $helm_version" \
     "into $bin (cold: ~7 min on 2 cores)" >&2
cd "$mod_dir"
# One `go build` for all nine programs, so the packages they share (client-go, grpc,
# protobuf, ...) compile once. -s -w and -trimpath cut link time and size.
"$go_bin" build -trimpath -o "$tmp/" \
  -ldflags "-s -w $k8s_ldflags $helm_ldflags $etcd_ldflags" \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kube-proxy \
  k8s.io/kubernetes/cmd/kubelet \
  k8s.io/kubernetes/cmd/kubectl \
  k8s.io/kubernetes/cmd/kubeadm \
  go.etcd.io/etcd/server/v3 \
  helm.sh/helm/v3/cmd/helm >&2
# go names the etcd server module's main package after its path ("server" for .../server/v3).
for name in server v3; do
  if [ -x "$tmp/$name" ]; then mv "$tmp/$name" "$tmp/etcd"; fi
done
for t in "${tools[@]}"; do
  if [ ! -x "$tmp/$t" ]; then
    echo "k8s-tools: the build did not produce $t (got: $(ls "$tmp"))" >&2
    exit 1
  fi
done
"$tmp/kubectl" version --client >&2
rm -rf "$bin"
mv "$tmp" "$bin"
echo "$stamp_value" >"$dest/stamp"
echo "k8s-tools: built in $((SECONDS - start)) s" >&2
echo "$bin"
