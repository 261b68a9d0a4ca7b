# Sourced by the hack/*.sh scripts: what they share.

# The folder kubeshard builds into once and reuses ($KUBESHARD_CACHE, default
# ~/.cache/kubeshard; empty counts as unset): the shell twin of
# kubeshard_shard.paths.cache_root().
cache="${KUBESHARD_CACHE:-$HOME/.cache/kubeshard}"

# build_lock FILE SECONDS WHAT: holds an exclusive lock on FILE (file descriptor 9) for
# the rest of the script, so two builds at once (several engineers, one machine) do not
# compile twice on two cores: the second waits for the first (at most SECONDS), then
# finds the result current.
build_lock() {
  mkdir -p "$(dirname "$1")"
  exec 9>"$1"
  if ! flock -w "$2" 9; then
    echo "$3: timed out after $(($2 / 60)) min waiting for another build (lock $1)" >&2
    exit 1
  fi
}

# etcd_image_tag: the tag of the etcd image kind's node carries (hack/images.sh kindnode)
# and kind's cluster config names (hack/e2e-kind.sh): the etcd pinned for hack/k8s-tools.sh,
# in kubeadm's form (3.7.3 -> 3.7.3-0).
etcd_image_tag() {
  awk '$1 == "go.etcd.io/etcd/server/v3" {print substr($2, 2) "-0"; exit}' "$(dirname "${BASH_SOURCE[0]}")/k8s-tools/go.mod"
}
