#!/usr/bin/env bash
# Installs the system packages kubeshard's tests and local cluster need, when missing:
# a real Redis server, iproute2 (network namespaces for pods), nftables/iptables and
# conntrack (kube-proxy), util-linux (unshare/nsenter) and busybox (the local cluster's
# busybox image). Debian/Ubuntu only; on other
# systems, install the same tools yourself.
set -euo pipefail

need=()
command -v redis-server >/dev/null || need+=(redis-server)
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
$sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# The Debian package starts a redis-server on 6379; tests start their own.
if [ -x /etc/init.d/redis-server ]; then $sudo /etc/init.d/redis-server stop >/dev/null 2>&1 || true; fi
