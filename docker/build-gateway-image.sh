#!/usr/bin/env bash
# Build the gateway's image from the repository root: docker/build-gateway-image.sh [TAG]
# The host's CA bundle is trusted during the build, so pip works where PyPI is reached through a
# TLS-intercepting proxy (as on the project's development machines); elsewhere it changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
tag="${1:-ares-gateway:latest}"
bundle="${ARES_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
[ -f "$bundle" ] && cp "$bundle" docker/certs/host-bundle.crt
exec docker build --network host -f docker/Dockerfile -t "$tag" .
