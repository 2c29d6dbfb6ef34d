#!/usr/bin/env bash
# Assembles the keel initrd: busybox (static), dmsetup and its libraries,
# and mkosi/initrd/init, as a reproducible zstd-compressed cpio archive.
# The kernel modules come from mkosi's kernel-modules initrd.
#
# The packages are Debian bookworm's, resolved against the image's own
# package sources (generated from the machine's apt configuration) with a
# private apt state, so the host's installed versions do not leak in.
#
# Usage: scripts/image-initrd.sh OUTPUT   (SOURCE_DATE_EPOCH fixes timestamps)
set -euo pipefail
source "$(dirname "$0")/image-lib.sh"

out=$(realpath -m "${1:?usage: $0 OUTPUT}")
dir=$KEEL_MKOSI_WORK/initrd
debs=$dir/debs
packages=(busybox-static dmsetup libdevmapper1.02.1 libselinux1 libudev1 libpcre2-8-0 libcap2 libc6)
epoch=$(source_date_epoch)

generate_sources
mkdir -p "$dir/lists/partial" "$dir/archives/partial" "$debs"
apt_opts=(
  -o "Dir::Etc::SourceList=/dev/null"
  -o "Dir::Etc::SourceParts=$KEEL_MKOSI_WORK/sources/image/etc/apt/sources.list.d"
  -o "Dir::State::Lists=$dir/lists"
  -o "Dir::State::Status=/dev/null"
  -o "Dir::Cache=$dir/cache"
  -o "APT::Sandbox::User=root"
  -q
)
apt-get "${apt_opts[@]}" update >"$dir/apt.log" 2>&1 || { cat "$dir/apt.log" >&2; die "apt-get update failed"; }
# Download only what is not cached yet; drop debs of superseded versions.
mapfile -t wanted < <(apt-get "${apt_opts[@]}" download --print-uris "${packages[@]}" 2>>"$dir/apt.log" |
  awk '{ print $2 }')
[ ${#wanted[@]} -eq ${#packages[@]} ] || { cat "$dir/apt.log" >&2; die "cannot resolve ${packages[*]}"; }
missing=0
for f in "${wanted[@]}"; do [ -f "$debs/$f" ] || missing=1; done
if [ $missing = 1 ]; then
  (cd "$debs" && apt-get "${apt_opts[@]}" download "${packages[@]}") >>"$dir/apt.log" 2>&1 ||
    { cat "$dir/apt.log" >&2; die "apt-get download failed"; }
fi
for f in "$debs"/*.deb; do
  printf '%s\n' "${wanted[@]}" | grep -qxF "$(basename "$f")" || rm -f "$f"
done

root=$dir/root
rm -rf "$root" "$dir/unpacked"
mkdir -p "$dir/unpacked"
for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$dir/unpacked"; done
u=$dir/unpacked

mkdir -p "$root"/{usr/bin,usr/sbin,usr/lib/x86_64-linux-gnu,usr/lib64,dev,proc,sys,sysroot,run}
ln -s usr/bin "$root/bin"
ln -s usr/sbin "$root/sbin"
ln -s usr/lib "$root/lib"
ln -s usr/lib64 "$root/lib64"
install -m 0755 "$u/bin/busybox" "$root/usr/bin/busybox"
ln -s busybox "$root/usr/bin/sh"
install -m 0755 "$u/sbin/dmsetup" "$root/usr/sbin/dmsetup"
# dmsetup's shared libraries (ldd would use the host's copies: list them).
for lib in libdevmapper.so.1.02.1 libselinux.so.1 libudev.so.1 libpcre2-8.so.0 libcap.so.2 libc.so.6 libm.so.6; do
  src=$(find "$u" -name "$lib" | head -1)
  [ -n "$src" ] || die "$lib not found in the unpacked packages"
  cp -L "$src" "$root/usr/lib/x86_64-linux-gnu/$lib"
done
cp -L "$u/lib64/ld-linux-x86-64.so.2" "$root/usr/lib64/ld-linux-x86-64.so.2" 2>/dev/null ||
  cp -L "$(find "$u" -name 'ld-linux-x86-64.so.2' | head -1)" "$root/usr/lib64/ld-linux-x86-64.so.2"
install -m 0755 "$KEEL_ROOT/mkosi/initrd/init" "$root/init"

# Reproducible archive: sorted names, fixed owner and timestamps.
find "$root" -exec touch -h -d "@$epoch" {} +
mkdir -p "$(dirname "$out")"
(cd "$root" && find . -mindepth 1 | LC_ALL=C sort |
  cpio --quiet -o -H newc -R 0:0 --reproducible) | zstd -q -19 -T1 -f -o "$out"
log "initrd: $out ($(stat -c %s "$out") bytes)"
