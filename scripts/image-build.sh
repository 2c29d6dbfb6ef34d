#!/usr/bin/env bash
# Builds the keel node image (mkosi/) with the static agent inside, then
# prints the paths, sizes and SHA-256 of the disk image, the UKI and the
# partitions.
#
# Usage: scripts/image-build.sh [OUTPUT_DIR]     (default build/image)
#        scripts/image-build.sh --prepare       only what needs no agent (package
#                                               sources, tools tree, stub, the
#                                               installed packages' cache), so it
#                                               can run while the agent builds
# Env:   KEEL_AGENT_BIN     agent binary to install (default: the musl release build)
#        KEEL_INITRD_BIN    the initrd's init (default: the musl release build)
#        KEEL_EXTRA_TREE    directory copied over the image root (experiments only)
#        SOURCE_DATE_EPOCH  timestamp for every file (default: the commit time)
#        KEEL_PACKAGE_CACHE package cache (default /var/cache/mkosi)
#        KEEL_IMAGE_FORCE=1 rebuild even if the output was built from the
#                           same inputs (agent, mkosi/, image scripts, epoch)
#        KEEL_IMAGE_INCREMENTAL=0  install the packages afresh, without the
#                           cache of installed packages (image-lib.sh)
set -euo pipefail
source "$(dirname "$0")/image-lib.sh"

if [ "${1:-}" = --prepare ]; then
  start=$(date +%s)
  generate_sources
  ensure_tools_tree
  ensure_stub_package
  ensure_image_cache "$(source_date_epoch)"
  log "prepared in $(( $(date +%s) - start )) s (package sources, tools tree, stub, installed packages)"
  exit 0
fi
out=$(realpath -m "${1:-$KEEL_IMAGE_OUT}")
work=$KEEL_MKOSI_WORK
mkdir -p "$work"

ensure_agent
normalize_checkout_modes
epoch=$(source_date_epoch)
# Everything the image is built from; an output built from the same inputs
# is kept (KEEL_IMAGE_FORCE=1 rebuilds anyway).
inputs=$(
  {
    echo "epoch $epoch"
    sha256sum "$KEEL_AGENT_BIN" "$KEEL_INITRD_BIN"
    (cd "$KEEL_ROOT" && find mkosi scripts/image-*.sh -type f -print0 | sort -z | xargs -0 sha256sum)
    (cd "$KEEL_ROOT" && find mkosi -type l -printf '%p -> %l\n' | sort)
    [ -z "${KEEL_EXTRA_TREE:-}" ] || (cd "$KEEL_EXTRA_TREE" && find . -type f -print0 | sort -z | xargs -0 sha256sum)
  } | sha256sum | cut -d' ' -f1
)
if [ "${KEEL_IMAGE_FORCE:-0}" != 1 ] && [ -f "$out/keel.raw" ] && [ -f "$out/keel.efi" ] &&
  [ "$(cat "$out/.inputs" 2>/dev/null)" = "$inputs" ]; then
  log "image in $out is up to date (inputs $(cut -c1-12 <<<"$inputs"))"
  report_artifacts "$out"
  exit 0
fi
generate_sources
ensure_tools_tree
ensure_stub_package
stage_agent "$work/agent-tree"

SOURCE_DATE_EPOCH=$epoch "$KEEL_ROOT/scripts/image-initrd.sh" "$work/initrd.cpio.zst"
rm -rf "$out"
mkdir -p "$out" "$work/workspace"
log "building the image into $out (SOURCE_DATE_EPOCH=$epoch)"
start=$(date +%s)
mapfile -t cache_opts < <(image_cache_opts "$epoch")
image_mkosi "$epoch" "${cache_opts[@]}" \
  --extra-tree "$work/agent-tree:/" \
  --initrd "$work/initrd.cpio.zst" \
  --output-dir "$out" \
  build >"$out.log" 2>&1 || { tail -40 "$out.log" >&2; die "mkosi failed (full log: $out.log)"; }
[ "${#cache_opts[@]}" = 0 ] || touch "$IMAGE_CACHE/filled"
# The record of inputs marks a complete output: the disk image and the UKI
# must both be there.
for f in keel.raw keel.efi; do
  [ -f "$out/$f" ] || die "mkosi finished but $out/$f is missing (full log: $out.log)"
done
echo "$inputs" >"$out/.inputs"
log "image built in $(( $(date +%s) - start )) s (log: $out.log)"
report_artifacts "$out"
