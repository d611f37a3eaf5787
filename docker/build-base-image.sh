#!/usr/bin/env bash
# Build a minimal Debian base image from Debian's own packages, without any container registry:
# debootstrap a root filesystem, then `docker import` it.  The Dockerfiles in this directory build
# FROM the tag this script produces (default: ares-gateway/debian-base:bookworm).
#
# Usage: docker/build-base-image.sh [--force]
# Environment:
#   ARES_BASE_IMAGE   tag to produce             (default ares-gateway/debian-base:bookworm)
#   DEBIAN_SUITE      Debian release             (default bookworm)
#   DEBIAN_MIRROR     package mirror URL         (default: the first one this host's apt uses)
#   DEBOOTSTRAP_VARIANT                          (default minbase)
set -euo pipefail

TAG="${ARES_BASE_IMAGE:-ares-gateway/debian-base:bookworm}"
SUITE="${DEBIAN_SUITE:-bookworm}"
VARIANT="${DEBOOTSTRAP_VARIANT:-minbase}"
FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

if [ "$FORCE" = 0 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "base image $TAG already present (use --force to rebuild)"
    exit 0
fi

command -v debootstrap >/dev/null || { echo "debootstrap is not installed: apt-get install debootstrap" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "debootstrap needs root" >&2; exit 1; }

# Use the mirror this host already uses, so the script works wherever apt does.
mirror="${DEBIAN_MIRROR:-}"
if [ -z "$mirror" ]; then
    mirror="$(grep -hE '^\s*URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -n1 || true)"
fi
if [ -z "$mirror" ]; then
    mirror="$(grep -hE '^\s*deb\s' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' | grep -v security | head -n1 || true)"
fi
[ -n "$mirror" ] || { echo "no Debian mirror found in apt sources: set DEBIAN_MIRROR" >&2; exit 1; }

root="$(mktemp -d /var/tmp/ares-debootstrap.XXXXXX)"
trap 'rm -rf "$root"' EXIT
echo "debootstrap $SUITE ($VARIANT) from $mirror into $root"
debootstrap --variant="$VARIANT" --include=ca-certificates,procps "$SUITE" "$root" "$mirror" >"$root.log" 2>&1 \
    || { tail -n 30 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"

# Make apt inside the image use the same mirror, and keep the image small.
echo "deb $mirror $SUITE main" >"$root/etc/apt/sources.list"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/* 2>/dev/null || true

tar -C "$root" -c . | docker import \
    --change 'CMD ["/bin/bash"]' \
    --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    - "$TAG"
echo "built $TAG"
