#!/usr/bin/env bash
# Makes sure a Docker engine answers on /var/run/docker.sock, starting Debian's dockerd
# with the settings these machines need when none runs (installed by
# hack/ensure-system-deps.sh --containers):
#
#   --add-runtime/--default-runtime  runc through hack/runc-wrapper, which drops the
#                                    capabilities this VM withholds (CAP_SYS_RESOURCE)
#                                    from each container's spec, so privileged
#                                    containers (kind's nodes) start
#   --iptables=false --ip-forward=false --ip-masq=false --bridge=none
#                                    Docker leaves the host's firewall, FORWARD policy
#                                    and forwarding alone: images are built with
#                                    --network host, and kind's nodes talk on their own
#                                    bridge network, which needs no NAT
#   cgroupfs, overlay2               the host has no systemd and a cgroup v1 hierarchy
#
# Usage: hack/docker.sh [up|down]. `down` stops only a dockerd this script started.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/lib.sh"  # $cache
state="$cache/docker"
mkdir -p "$state"

case "${1:-up}" in
  up)
    if docker info >/dev/null 2>&1; then exit 0; fi
    command -v dockerd >/dev/null || "$here/ensure-system-deps.sh" --containers
    wrapper="$("$here/node-tools.sh" runc-wrapper)"
    echo "docker: starting dockerd (log $state/dockerd.log)" >&2
    # dockerd outlives its caller, so it must not inherit the caller's descriptors:
    # hack/images.sh holds its build locks on 7 and 8, and a dockerd holding one blocked
    # the next build of that image for the lock's hour.
    setsid dockerd --iptables=false --ip-forward=false --ip-masq=false --bridge=none \
      --add-runtime "kubeshard-runc=$wrapper" --default-runtime=kubeshard-runc \
      --storage-driver=overlay2 --exec-opt native.cgroupdriver=cgroupfs \
      --pidfile "$state/dockerd.pid" >>"$state/dockerd.log" 2>&1 </dev/null 7>&- 8>&- 9>&- &
    for _ in $(seq 1 120); do
      if docker info >/dev/null 2>&1; then exit 0; fi
      sleep 0.5
    done
    echo "docker: dockerd did not answer within 60 s; last lines of $state/dockerd.log:" >&2
    tail -20 "$state/dockerd.log" >&2
    exit 1
    ;;
  down)
    if [ -f "$state/dockerd.pid" ]; then
      pid="$(cat "$state/dockerd.pid")"
      if [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = dockerd ]; then
        kill -TERM "$pid"
        for _ in $(seq 1 60); do [ -d /proc/"$pid" ] || break; sleep 0.5; done
      fi
    fi
    ;;
  *) echo "usage: $0 [up|down]" >&2; exit 2 ;;
esac
