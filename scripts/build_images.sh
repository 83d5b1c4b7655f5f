#!/usr/bin/env bash
# Build the Sluice images with podman on a machine that reaches no image registry (`make images`).
#
# No base image can be pulled, so one is made here: a minimal Debian 12 root filesystem (debootstrap) with its
# Python 3.11 and pip, imported as localhost/sluice-base:bookworm and passed to every Dockerfile as BASE
# (with a registry, leave BASE at its default python:3.11-slim, pinned by digest). The builds see this
# machine's package sources (pip.conf, /opt/wheels, the local indexes and the CA bundle its registry proxy needs)
# read-only, and use the host network. Docker format: OCI images have no HEALTHCHECK.
# Podman runs as ../shared/ENGINES.md says works on this kind of machine: runc, cgroupfs, host ulimits.
#   IMAGES="router" scripts/build_images.sh      # only some images
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGES=${IMAGES:-"router scheduler admission planner worker"}
BASE=${BASE:-localhost/sluice-base:bookworm}
WORK=${WORK:-out/images}
mkdir -p "$WORK"
CONF="$WORK/containers.conf"
printf '[containers]\ndefault_ulimits = []\n' > "$CONF"
export CONTAINERS_CONF="$PWD/$CONF"
PODMAN=(podman --runtime runc --cgroup-manager cgroupfs)

if ! "${PODMAN[@]}" image exists "$BASE"; then
  rootfs="$WORK/rootfs"
  rm -rf "$rootfs"
  debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,python-is-python3,ca-certificates \
    bookworm "$rootfs" http://deb.debian.org/debian >"$WORK/debootstrap.log"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  # Debian marks its Python externally managed (PEP 668); an image has no other Python to protect.
  tar -C "$rootfs" -c . | "${PODMAN[@]}" import \
    --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' --change 'CMD ["python3"]' - "$BASE"
  rm -rf "$rootfs"
fi

mounts=()
for path in /etc/pip.conf /etc/xdg/pip /opt/wheels /opt/pypi /opt/pypi-more /etc/ssl/certs/ca-certificates.crt; do
  [ -e "$path" ] && mounts+=(-v "$path:$path:ro")
done
# The builds run as root in the container: the user's pip.conf (find-links, local indexes) goes to root's.
[ -e "$HOME/.config/pip/pip.conf" ] && mounts+=(-v "$HOME/.config/pip/pip.conf:/root/.config/pip/pip.conf:ro")
# The worker's torch index: the local one when there is one (download.pytorch.org is not reachable here).
[ -d /opt/pypi/simple ] && mounts+=(--build-arg "TORCH_INDEX=file:///opt/pypi/simple")
for image in $IMAGES; do
  echo "building sluice-$image:0.1.0" >&2
  "${PODMAN[@]}" build --format docker --network host "${mounts[@]}" --build-arg "BASE=$BASE" \
    -f "deploy/docker/$image.Dockerfile" -t "sluice-$image:0.1.0" . >"$WORK/build-$image.log" 2>&1 \
    || { tail -30 "$WORK/build-$image.log" >&2; exit 1; }
done
"${PODMAN[@]}" images --filter reference='sluice-*' --format '{{.Repository}}:{{.Tag}} {{.Size}}'
