#!/usr/bin/env bash
# Builds (or reuses) every container image the local cluster and kind run, without any
# image registry, and saves each as a tarball under $KUBESHARD_CACHE/images:
#
#   base      kubeshard.local/debian-python:bookworm: `debootstrap --variant=minbase
#             bookworm` plus python3, python3-venv and ca-certificates, `docker import`ed
#   operator  ghcr.io/kubeshard/operator:<appVersion>      operator/Dockerfile
#   router    ghcr.io/kubeshard/router:<appVersion>        router/Dockerfile
#   shard     ghcr.io/kubeshard/shard-server:<appVersion>  shard_server/Dockerfile
#   pause     registry.k8s.io/pause:3.10 (the sandbox image; hack/images/pause.c)
#   standins  python:3.11, python:3.12, busybox:1.36, busybox:1.37, redis:7.4-alpine:
#             the third-party images the chart and the e2e tests name, built from
#             Debian's packages (hack/images/standins/; each says so in a label)
#   kindnode  kubeshard.local/kind-node:<kubernetes version>: kind's node image, assembled
#             here (hack/kind/node/): the Kubernetes binaries of hack/k8s-tools.sh, and
#             the control plane's, kube-proxy, etcd, CoreDNS and pause images inside it,
#             and kube-router's (its NetworkPolicy engine, hack/kind/kube-router.yaml).
#             Built only when named (`make e2e-kind`).
#   llamacpp  ghcr.io/kubeshard/llamacpp-server:<version> (the operator's default image of
#             spec.runtime llamacpp, operator/kubeshard_operator/config.py): llama.cpp's
#             server, compiled from the sdist of the version hack/engines.sh pins
#             (hack/llamacpp/Dockerfile; about 8 minutes cold on two cores), for the
#             e2e test of that runtime.
#
# A tarball's name carries a hash of everything its image is built from (Dockerfile,
# the parts' sources, constraints.txt, the base), so a change rebuilds it and an
# unchanged tree reuses it without Docker. Package registries are reached from the
# build with the host's network and its extra CA certificates
# (/usr/local/share/ca-certificates, passed as EXTRA_CA_CERTS to build stages only).
#
# Usage: hack/images.sh [GROUP...]   (default: all but kindnode); prints one tarball path
#          per line.
#        hack/images.sh --load GROUP...   also makes sure Docker has the images (kind).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
. "$here/lib.sh"  # $cache
out="$cache/images"
mkdir -p "$out"

load=""
if [ "${1:-}" = "--load" ]; then load=1; shift; fi
groups=("$@")
[ ${#groups[@]} -gt 0 ] || groups=(pause standins operator router shard llamacpp)

tag="$(awk -F'"' '/^appVersion:/ {print $2}' "$root/charts/kubeshard/Chart.yaml")"
BASE_REF=kubeshard.local/debian-python:bookworm
BASE_PACKAGES=python3,python3-venv,ca-certificates
SUITE=bookworm

hash_files() { # files or folders (tracked and untracked, not ignored) -> one hash
  (cd "$root" && git ls-files -co --exclude-standard -- "$@" | LC_ALL=C sort \
     | while read -r f; do [ -f "$f" ] && { echo "$f"; cat "$f"; }; done) | sha256sum | cut -c1-16
}

# Bump BASE_REVISION when ensure_base changes what it puts into the rootfs.
BASE_REVISION=1
base_key() { echo "$SUITE $BASE_PACKAGES $BASE_REVISION" | sha256sum | cut -c1-16; }

docker_up() { "$here/docker.sh" up; }

extra_ca() { # the host's extra CA certificates, PEM
  cat /usr/local/share/ca-certificates/*.crt 2>/dev/null || true
}

ensure_base() { # the base image in Docker (from the cached rootfs when there is one)
  local key rootfs
  key="$(base_key)"
  rootfs="$out/debian-python-$key.rootfs.tar"
  if docker image inspect "$BASE_REF" --format '{{index .Config.Labels "io.kubeshard.key"}}' 2>/dev/null \
       | grep -qx "$key"; then return; fi
  exec 7>"$out/base.lock"
  flock -w 3600 7
  if [ ! -f "$rootfs" ]; then
    command -v debootstrap >/dev/null || "$here/ensure-system-deps.sh" --containers
    local tmp; tmp="$(mktemp -d "$out/rootfs.XXXX")"
    echo "images: debootstrap $SUITE into $tmp (about 75 s)" >&2
    local start=$SECONDS
    debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$tmp/root" \
      http://deb.debian.org/debian >"$tmp/debootstrap.log" 2>&1 \
      || { tail -20 "$tmp/debootstrap.log" >&2; rm -rf "$tmp"; exit 1; }
    # apt inside images (the redis stand-in) uses the same mirrors as the host.
    printf 'deb http://deb.debian.org/debian %s main\ndeb http://deb.debian.org/debian %s-updates main\ndeb http://deb.debian.org/debian-security %s-security main\n' \
      "$SUITE" "$SUITE" "$SUITE" >"$tmp/root/etc/apt/sources.list"
    rm -rf "$tmp/root/var/cache/apt/archives/"*.deb "$tmp/root/var/lib/apt/lists/"* \
           "$tmp/root/usr/share/doc" "$tmp/root/usr/share/man" "$tmp/root/usr/share/locale"
    tar -C "$tmp/root" --numeric-owner -cf "$rootfs.tmp" .
    mv "$rootfs.tmp" "$rootfs"
    rm -rf "$tmp"
    echo "images: base rootfs in $((SECONDS - start)) s" >&2
  fi
  docker import --change "LABEL io.kubeshard.key=$key" --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' "$rootfs" "$BASE_REF" >/dev/null
  exec 7>&-
}

# build GROUP KEY REFS... -- DOCKER_BUILD_ARGS...: build unless its tarball exists, save it.
build() {
  local group="$1" key="$2"; shift 2
  local refs=()
  while [ "$1" != "--" ]; do refs+=("$1"); shift; done
  shift
  local tarball="$out/$group-$key.tar"
  # One build of a group at a time (several `make test`s on one machine); the others
  # wait, then find its tarball.
  [ -f "$tarball" ] || { exec 8>"$out/$group.lock"; flock -w 3600 8; }
  if [ -f "$tarball" ]; then
    exec 8>&-
    if [ -n "$load" ] && ! docker image inspect "${refs[@]}" >/dev/null 2>&1; then
      docker_up; docker load -q -i "$tarball" >/dev/null
    fi
    echo "$tarball"; return
  fi
  docker_up
  local start=$SECONDS
  echo "images: building $group (${refs[*]})" >&2
  "$@" >"$out/$group.build.log" 2>&1 || { tail -40 "$out/$group.build.log" >&2; exit 1; }
  docker save -o "$tarball.tmp" "${refs[@]}"
  docker image prune -f >/dev/null  # earlier builds' untagged stages
  mv "$tarball.tmp" "$tarball"
  rm -f "$out/$group"-*.tar.old
  for old in "$out/$group"-*.tar; do [ "$old" = "$tarball" ] || rm -f "$old"; done
  exec 8>&-
  echo "images: $group built and saved in $((SECONDS - start)) s" >&2
  echo "$tarball"
}

dockerfile_build() { # DOCKERFILE REF [more -t refs]: docker build with the base and CAs
  local file="$1"; shift
  local tags=()
  for r in "$@"; do tags+=(-t "$r"); done
  ensure_base
  local args=(--network host --force-rm -f "$file" --build-arg "BASE_IMAGE=$BASE_REF"
              --build-arg "EXTRA_CA_CERTS=$(extra_ca)")
  # The build stage under a name of its own first: its layers (the dependencies) stay
  # cached when `docker image prune` removes the untagged leftovers of older builds.
  docker build "${args[@]}" --target build -t "kubeshard.local/build-cache/$(basename "$(dirname "$file")"):latest" "$root" &&
  docker build "${args[@]}" "${tags[@]}" "$root"
}

part() { # GROUP DOCKERFILE IMAGE SOURCES...
  local group="$1" file="$2" image="$3"; shift 3
  local key; key="$(echo "$(base_key) $(hash_files "$file" .dockerignore constraints.txt hack/images "$@")" | sha256sum | cut -c1-16)"
  build "$group" "$key" "$image:$tag" -- dockerfile_build "$root/$file" "$image:$tag"
}

for group in "${groups[@]}"; do
  case "$group" in
    base) docker_up; ensure_base ;;
    operator) part operator operator/Dockerfile ghcr.io/kubeshard/operator operator ;;
    router) part router router/Dockerfile ghcr.io/kubeshard/router proto router ;;
    shard) part shard shard_server/Dockerfile ghcr.io/kubeshard/shard-server proto shard_server ;;
    pause)
      pause_bin="$("$here/node-tools.sh" pause)"
      key="$(echo "$(sha256sum "$pause_bin") $(hash_files hack/images/pause.Dockerfile)" | sha256sum | cut -c1-16)"
      build pause "$key" registry.k8s.io/pause:3.10 -- \
        docker build -f "$here/images/pause.Dockerfile" -t registry.k8s.io/pause:3.10 "$(dirname "$pause_bin")"
      ;;
    standins)
      busybox_bin="$(command -v busybox)"
      key="$(echo "$(base_key) $(sha256sum "$busybox_bin") $(hash_files hack/images/standins)" | sha256sum | cut -c1-16)"
      standins() {
        local ctx; ctx="$(mktemp -d)"
        cp "$busybox_bin" "$ctx/busybox"
        ensure_base
        docker build -f "$here/images/standins/busybox.Dockerfile" -t busybox:1.36 -t busybox:1.37 "$ctx" &&
        docker build --network host -f "$here/images/standins/python.Dockerfile" --build-arg "BASE_IMAGE=$BASE_REF" \
          -t python:3.11 -t python:3.12 "$ctx" &&
        docker build --network host -f "$here/images/standins/redis.Dockerfile" --build-arg "BASE_IMAGE=$BASE_REF" \
          -t redis:7.4-alpine "$ctx"
        local rc=$?
        rm -rf "$ctx"
        return $rc
      }
      if ! file -L "$busybox_bin" 2>/dev/null | grep -q 'statically linked' && ldd "$busybox_bin" >/dev/null 2>&1; then
        echo "images: $busybox_bin is not static (install busybox-static)" >&2; exit 1
      fi
      build standins "$key" python:3.11 python:3.12 busybox:1.36 busybox:1.37 redis:7.4-alpine -- standins
      ;;
    kindnode)
      k8s_dir="$(dirname "$("$here/k8s-tools.sh" | tail -1)")"
      k8s_version="$(basename "$k8s_dir")"
      node_bin="$(dirname "$("$here/node-tools.sh" runc-wrapper crictl coredns pause kube-router | tail -1)")"
      etcd_tag="$(etcd_image_tag)"
      kube_router_image="kubeshard.local/kube-router:$(awk '$1 == "require" && $2 ~ /kube-router/ {print $3}' "$here/netpol/go.mod")"
      key="$(echo "$(base_key) $(cat "$k8s_dir/stamp") $(cat "$node_bin"/{runc-wrapper,crictl,coredns,pause,kube-router}.stamp)" \
               "$(hash_files hack/kind/node hack/kind/kube-router.yaml hack/images/pause.Dockerfile)" | sha256sum | cut -c1-16)"
      kind_node() {
        local ctx rc=0
        ctx="$(mktemp -d)"
        ( set -e
          b="$k8s_dir/bin" r=registry.k8s.io
          mkdir -p "$ctx/bin" "$ctx/images"
          cp -r "$here/kind/node/rootfs" "$ctx/rootfs"
          cp "$b/kubeadm" "$b/kubelet" "$b/kubectl" "$node_bin/crictl" "$node_bin/runc-wrapper" "$ctx/bin/"
          ensure_base
          export BASE_IMAGE="$BASE_REF"
          for c in kube-apiserver kube-controller-manager kube-scheduler kube-proxy; do
            "$here/kind/node/component.sh" "$c" "$b/$c" "$r/$c:$k8s_version" "$ctx/images/$c.tar"
          done
          "$here/kind/node/component.sh" etcd "$b/etcd" "$r/etcd:$etcd_tag" "$ctx/images/etcd.tar"
          "$here/kind/node/component.sh" coredns "$node_bin/coredns" "$r/coredns/coredns:v1.14.6" "$ctx/images/coredns.tar"
          "$here/kind/node/component.sh" kube-router "$node_bin/kube-router" "$kube_router_image" "$ctx/images/kube-router.tar"
          # kind applies the node's default-cni.yaml after kubeadm: here, kube-router's DaemonSet
          mkdir -p "$ctx/rootfs/kind/manifests"
          sed "s|@KUBE_ROUTER_IMAGE@|$kube_router_image|g" "$here/kind/kube-router.yaml" \
            >"$ctx/rootfs/kind/manifests/default-cni.yaml"
          cp "$("$0" pause | tail -1)" "$ctx/images/pause.tar"  # the pause group's tarball
          docker build --network host -f "$here/kind/node/Dockerfile" --build-arg "BASE_IMAGE=$BASE_REF" \
            --build-arg "KUBERNETES_VERSION=$k8s_version" -t "kubeshard.local/kind-node:$k8s_version" "$ctx"
        ) || rc=$?
        rm -rf "$ctx"
        return $rc
      }
      build kindnode "$key" "kubeshard.local/kind-node:$k8s_version" -- kind_node
      ;;
    llamacpp)
      ref="$(sed -n 's/^DEFAULT_LLAMACPP_IMAGE = "\(.*\)"$/\1/p' "$root/operator/kubeshard_operator/config.py")"
      version="$(awk -F= '$1 == "LLAMACPP_VERSION" {print $2}' "$here/engines.sh")"
      [ "${ref##*:}" = "$version" ] || {
        echo "images: the operator's llama.cpp image $ref is not hack/engines.sh's version $version" >&2; exit 1; }
      key="$(echo "$(base_key) $version $(hash_files hack/llamacpp/Dockerfile hack/images/pip-ca.sh)" \
               | sha256sum | cut -c1-16)"
      llamacpp() {
        ensure_base
        docker build --network host --force-rm -f "$here/llamacpp/Dockerfile" \
          --build-arg "BASE_IMAGE=$BASE_REF" --build-arg "EXTRA_CA_CERTS=$(extra_ca)" \
          --build-arg "LLAMACPP_VERSION=$version" --build-arg "JOBS=${KUBESHARD_ENGINE_JOBS:-2}" \
          -t "$ref" "$root"
      }
      build llamacpp "$key" "$ref" -- llamacpp
      ;;
    *) echo "images: unknown group $group (base operator router shard pause standins kindnode llamacpp)" >&2; exit 2 ;;
  esac
done
