#!/usr/bin/env bash
# Proves the image build is reproducible: builds the image three times, each
# time into an empty output directory (the tools tree and package cache are
# shared), and compares the SHA-256 of every artifact: disk image, UKI,
# partitions, kernel and initrd. Names every artifact that differs.
#   a: without the installed-packages cache (KEEL_IMAGE_INCREMENTAL=0);
#   b: with an emptied cache: installs the packages again and fills it; run
#      from a checkout whose image files are private to their owner, as a
#      clone on a machine with umask 077 would be;
#   c: from the cache b filled, as a build after `make image-prepare` does.
# So two installs from the packages agree, and the cache changes no byte.
#
# Usage: scripts/image-repro.sh     (exit 0 only if every artifact is identical)
set -euo pipefail
source "$(dirname "$0")/image-lib.sh"

repro=$KEEL_BUILD/repro
rm -rf "$repro"
mkdir -p "$repro"
# One timestamp for every build, even if a commit lands in between.
SOURCE_DATE_EPOCH=$(source_date_epoch)
export SOURCE_DATE_EPOCH
start=$(date +%s)
log "reproducibility build a (no cache)"
KEEL_IMAGE_INCREMENTAL=0 "$KEEL_ROOT/scripts/image-build.sh" "$repro/a" >"$repro/a.report"
rm -rf "$IMAGE_CACHE"
log "reproducibility build b (fills the cache; checkout modes private)"
# Build a left the checkout's modes as image-build.sh sets them; they are
# set so again however this script ends, a failed build b included.
trap normalize_checkout_modes EXIT
chmod -R go-rwx "$KEEL_ROOT/mkosi/mkosi.extra"
"$KEEL_ROOT/scripts/image-build.sh" "$repro/b" >"$repro/b.report"
log "reproducibility build c (from the cache)"
"$KEEL_ROOT/scripts/image-build.sh" "$repro/c" >"$repro/c.report"

status=0
printf '%-24s %s\n' artifact result
# The disk image and the UKI must be compared: were they renamed, the loop
# below would find nothing and prove nothing. It compares each of build a's
# artifacts with builds b and c and names one missing there.
for name in keel.raw keel.efi; do
  [ -f "$repro/a/$name" ] || { printf '%-24s MISSING in build a\n' "$name"; status=1; }
done
for f in "$repro"/a/keel.raw "$repro"/a/keel.efi "$repro"/a/keel.*.raw "$repro"/a/keel.initrd "$repro"/a/keel.vmlinuz; do
  [ -f "$f" ] || continue
  name=$(basename "$f")
  a=$(sha256sum "$f" | cut -d' ' -f1)
  result="identical $a"
  for run in b c; do
    if [ ! -f "$repro/$run/$name" ]; then
      result="MISSING in build $run"
      status=1
    elif other=$(sha256sum "$repro/$run/$name" | cut -d' ' -f1) && [ "$other" != "$a" ]; then
      result="DIFFERS: a $a, $run $other"
      status=1
    fi
  done
  printf '%-24s %s\n' "$name" "$result"
done
for run in b c; do
  for f in "$repro/$run"/keel*; do
    [ -e "$repro/a/$(basename "$f")" ] || { printf '%-24s MISSING in build a\n' "$(basename "$f")"; status=1; }
  done
done
log "three builds in $(( $(date +%s) - start )) s: $([ $status = 0 ] && echo reproducible || echo NOT reproducible)"
# The three images (some 2.3 GB) prove nothing more once compared: kept only
# when they differ, for diffoscope; the logs and reports stay.
if [ $status = 0 ]; then
  rm -rf "$repro/a" "$repro/b" "$repro/c"
fi
exit $status
