#!/usr/bin/env bash
# A base image for container/Containerfile made from Debian packages alone, for a machine that
# reaches a Debian mirror but no image registry: debootstrap writes a minimal Debian 12 root
# filesystem (with its Python 3.11) and the container engine imports it as an image.
#
#   sudo container/debian_base.sh [IMAGE] [MIRROR]
#   podman build -f container/Containerfile --build-arg BASE=localhost/loongsage-debian-base:bookworm -t loongsage:cpu .
#
# Needs root (debootstrap chroots), debootstrap and podman (or docker: ENGINE=docker).
set -euo pipefail
image=${1:-localhost/loongsage-debian-base:bookworm}
mirror=${2:-http://deb.debian.org/debian}
engine=${ENGINE:-podman}
for tool in debootstrap "$engine"; do
    command -v "$tool" >/dev/null || { echo "debian_base.sh: $tool is not installed (apt-get install $tool)" >&2; exit 1; }
done
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates bookworm "$root" "$mirror"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
# the mirror the image's apt-get uses later
echo "deb $mirror bookworm main" > "$root/etc/apt/sources.list"
tar --numeric-owner -C "$root" -c . | "$engine" import --change 'CMD ["/bin/bash"]' - "$image"
echo "debian_base.sh: $image"
