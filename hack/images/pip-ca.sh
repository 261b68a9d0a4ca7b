#!/bin/sh
# Runs a command (pip) trusting Debian's CA certificates plus $EXTRA_CA_CERTS (PEM), so
# an image build behind a TLS-inspecting proxy reaches PyPI. Build stages only: the
# bundle is written to /tmp of the build stage, which no final image copies.
set -e
if [ -n "${EXTRA_CA_CERTS:-}" ]; then
  cat /etc/ssl/certs/ca-certificates.crt >/tmp/pip-ca.pem
  printf '%s\n' "$EXTRA_CA_CERTS" >>/tmp/pip-ca.pem
  export PIP_CERT=/tmp/pip-ca.pem
fi
exec "$@"
