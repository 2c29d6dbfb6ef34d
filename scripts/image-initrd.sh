#!/usr/bin/env bash
# Assembles the keel initrd: the static keel-initrd binary (crate initrd/)
# as /init, the two device nodes the kernel and the binary's runtime open
# before /dev is mounted, and the empty mount points, as a reproducible
# zstd-compressed cpio archive. The kernel modules come from mkosi's
# kernel-modules initrd.
#
# Usage: scripts/image-initrd.sh OUTPUT   (SOURCE_DATE_EPOCH fixes timestamps)
# Env:   KEEL_INITRD_BIN   the init binary (default: the musl release build)
set -euo pipefail
source "$(dirname "$0")/image-lib.sh"

out=$(realpath -m "${1:?usage: $0 OUTPUT}")
epoch=$(source_date_epoch)
[ -x "$KEEL_INITRD_BIN" ] || die "initrd binary $KEEL_INITRD_BIN is missing: run 'make agent'"

root=$KEEL_MKOSI_WORK/initrd-root
rm -rf "$root"
# usr/lib: mkosi's modules initrd, unpacked after this one, starts at
# usr/lib/modules, and the kernel creates no missing parent directories.
mkdir -p "$root"/{dev,proc,sys,sysroot,usr/lib}
install -m 0755 "$KEEL_INITRD_BIN" "$root/init"
# The kernel gives init /dev/console as its standard streams if the node
# exists; a Rust program opens /dev/null for any that are closed.
mknod -m 0600 "$root/dev/console" c 5 1 || die "mknod needs root"
mknod -m 0666 "$root/dev/null" c 1 3

# Reproducible archive: sorted names, fixed owner and timestamps. The
# compression window is no larger than the archive (under 512 KiB): the
# kernel allocates a window's worth of memory to unpack it.
find "$root" -exec touch -h -d "@$epoch" {} +
mkdir -p "$(dirname "$out")"
(cd "$root" && find . -mindepth 1 | LC_ALL=C sort |
  cpio --quiet -o -H newc -R 0:0 --reproducible) | zstd -q -19 --zstd=wlog=19 -T1 -f -o "$out"
log "initrd: $out ($(stat -c %s "$out") bytes)"
