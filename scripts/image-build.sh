#!/usr/bin/env bash
# Builds the keel node image (mkosi/) with the static agent inside, then
# prints the paths, sizes and SHA-256 of the disk image, the UKI and the
# partitions.
#
# Usage: scripts/image-build.sh [OUTPUT_DIR]     (default build/image)
# Env:   KEEL_AGENT_BIN     agent binary to install (default: the musl release build)
#        KEEL_EXTRA_TREE    directory copied over the image root (experiments only)
#        SOURCE_DATE_EPOCH  timestamp for every file (default: the commit time)
#        KEEL_PACKAGE_CACHE package cache (default /var/cache/mkosi)
set -euo pipefail
source "$(dirname "$0")/image-lib.sh"

out=$(realpath -m "${1:-$KEEL_IMAGE_OUT}")
work=$KEEL_MKOSI_WORK
mkdir -p "$work"

ensure_agent
generate_sources
ensure_tools_tree
ensure_stub_package
stage_agent "$work/agent-tree"

epoch=$(source_date_epoch)
SOURCE_DATE_EPOCH=$epoch "$KEEL_ROOT/scripts/image-initrd.sh" "$work/initrd.cpio.zst"
rm -rf "$out"
mkdir -p "$out" "$work/workspace"
log "building the image into $out (SOURCE_DATE_EPOCH=$epoch)"
start=$(date +%s)
mkosi \
  --directory "$KEEL_ROOT/mkosi" \
  --tools-tree "$work/tools/tools" \
  --package-manager-tree "$work/sources/image" \
  --extra-tree "$work/agent-tree:/" \
  --initrd "$work/initrd.cpio.zst" \
  --output-dir "$out" \
  --workspace-dir "$work/workspace" \
  --package-cache-dir "$KEEL_PACKAGE_CACHE" \
  --source-date-epoch "$epoch" \
  --force \
  build >"$out.log" 2>&1 || { tail -40 "$out.log" >&2; die "mkosi failed (full log: $out.log)"; }
log "image built in $(( $(date +%s) - start )) s (log: $out.log)"
report_artifacts "$out"
