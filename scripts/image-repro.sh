#!/usr/bin/env bash
# Proves the image build is reproducible: builds the image twice, each time
# into an empty output directory (the tools tree and package cache are
# shared), and compares the SHA-256 of every artifact: disk image, UKI,
# partitions, kernel and initrd. Names every artifact that differs.
#
# Usage: scripts/image-repro.sh     (exit 0 only if every artifact is identical)
set -euo pipefail
source "$(dirname "$0")/image-lib.sh"

repro=$KEEL_BUILD/repro
rm -rf "$repro"
mkdir -p "$repro"
# One timestamp for both builds, even if a commit lands in between.
SOURCE_DATE_EPOCH=$(source_date_epoch)
export SOURCE_DATE_EPOCH
start=$(date +%s)
for run in a b; do
  log "reproducibility build $run"
  "$KEEL_ROOT/scripts/image-build.sh" "$repro/$run" >"$repro/$run.report"
done

status=0
printf '%-24s %s\n' artifact result
for f in "$repro"/a/keel.raw "$repro"/a/keel.efi "$repro"/a/keel.*.raw "$repro"/a/keel.initrd "$repro"/a/keel.vmlinuz; do
  [ -f "$f" ] || continue
  name=$(basename "$f")
  a=$(sha256sum "$f" | cut -d' ' -f1)
  if [ ! -f "$repro/b/$name" ]; then
    printf '%-24s MISSING in the second build\n' "$name"
    status=1
  elif b=$(sha256sum "$repro/b/$name" | cut -d' ' -f1) && [ "$a" = "$b" ]; then
    printf '%-24s identical %s\n' "$name" "$a"
  else
    printf '%-24s DIFFERS %s vs %s\n' "$name" "$a" "$b"
    status=1
  fi
done
for f in "$repro"/b/keel*; do
  [ -e "$repro/a/$(basename "$f")" ] || { printf '%-24s MISSING in the first build\n' "$(basename "$f")"; status=1; }
done
log "two builds in $(( $(date +%s) - start )) s: $([ $status = 0 ] && echo reproducible || echo NOT reproducible)"
exit $status
