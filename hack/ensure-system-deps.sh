#!/usr/bin/env bash
# Installs the system packages kubeshard's tests and local cluster need, when missing:
# a real Redis server, curl, iproute2 (network namespaces for pods), nftables/iptables and
# conntrack (kube-proxy), util-linux (unshare/nsenter) and busybox (the local cluster's
# busybox image). With --containers, also what real containers need: Debian's Docker
# engine (image builds, kind), containerd and runc (the local cluster's node), the CNI
# plugins, debootstrap (the registry-free base image), ipset (the NetworkPolicy engine)
# and a static busybox (the busybox stand-in image). Debian/Ubuntu only; on other
# systems, install the same tools yourself.
set -euo pipefail

need=()
if [ "${1:-}" = "--containers" ]; then
  command -v dockerd >/dev/null || need+=(docker.io)
  command -v containerd >/dev/null || need+=(containerd)
  command -v runc >/dev/null || need+=(runc)
  [ -x /usr/lib/cni/ptp ] || need+=(containernetworking-plugins)
  command -v debootstrap >/dev/null || need+=(debootstrap)
  command -v ipset >/dev/null || need+=(ipset)
  dpkg -s busybox-static >/dev/null 2>&1 || need+=(busybox-static)
fi
command -v redis-server >/dev/null || need+=(redis-server)
# The README's examples, pasted by tests/cli/test_serve.py.
command -v curl >/dev/null || need+=(curl)
command -v ip >/dev/null || need+=(iproute2)
command -v nft >/dev/null || need+=(nftables)
command -v iptables >/dev/null || need+=(iptables)
command -v conntrack >/dev/null || need+=(conntrack)
command -v unshare >/dev/null || need+=(util-linux)
# The local cluster's `busybox` image runs the real busybox applets.
command -v busybox >/dev/null || need+=(busybox)
# The playground's browser test (tests/router/test_playground_browser.py): Debian's headless
# Chromium and its WebDriver (never a browser a test tool downloads).
command -v chromium >/dev/null || need+=(chromium)
command -v chromedriver >/dev/null || need+=(chromium-driver)

if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi

if ! command -v apt-get >/dev/null; then
  echo "kubeshard: missing system tools: ${need[*]} (no apt-get here: install them yourself)" >&2
  exit 1
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then sudo="sudo"; else
    echo "kubeshard: missing system tools: ${need[*]}; run as root or install them" >&2
    exit 1
  fi
fi

echo "kubeshard: installing system packages: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
# Packages must not start their services (docker.io would start a dockerd that rewrites
# the host's firewall): hack/docker.sh starts dockerd with this machine's settings.
policy=/usr/sbin/policy-rc.d
added_policy=""
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod +x "$policy"
  added_policy=1
fi
$sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
if [ -n "$added_policy" ]; then $sudo rm -f "$policy"; fi
# The Debian package starts a redis-server on 6379; tests start their own.
if [ -x /etc/init.d/redis-server ]; then $sudo /etc/init.d/redis-server stop >/dev/null 2>&1 || true; fi
