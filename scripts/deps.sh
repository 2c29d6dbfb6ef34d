#!/usr/bin/env bash
# Installs every host package the build, the tests and the image need.
# Idempotent. Package sources are derived from the machine's own apt
# configuration, so a local mirror is followed and no host is named here.
set -euo pipefail

APT=(apt-get -o DPkg::Lock::Timeout=600 -y -q)
export DEBIAN_FRONTEND=noninteractive
src=/etc/apt/sources.list.d/debian.sources

# First deb822 stanza of the machine's sources, with Types/Suites rewritten.
derive_stanza() { # $1 = Types value, $2 = Suites value
  awk -v types="$1" -v suites="$2" '
    /^[[:space:]]*$/ { if (seen) exit; next }
    /^#/ { next }
    { seen = 1 }
    /^Types:/  { print "Types: " types; next }
    /^Suites:/ { print "Suites: " suites; next }
    { print }
  ' "$src"
}

# apt, the backports source below, mkosi's caches and the image's device
# nodes all need root.
if [ "$(id -u)" != 0 ]; then
  echo "deps: run as root (it installs packages and adds the bookworm-backports source; the image build needs root too), with Rust installed for root by rustup" >&2
  exit 1
fi

if [ ! -f "$src" ]; then
  echo "deps: $src not found; cannot derive package sources" >&2
  exit 1
fi

backports=/etc/apt/sources.list.d/keel-backports.sources
want=$(derive_stanza deb bookworm-backports)
if [ ! -f "$backports" ] || [ "$(cat "$backports")" != "$want" ]; then
  printf '%s\n' "$want" >"$backports"
  stale=1
fi

host_pkgs=(swtpm swtpm-tools tpm2-tools ovmf erofs-utils squashfs-tools dosfstools
  mtools cryptsetup-bin kmod cpio python3-pefile zstd uidmap bubblewrap musl-tools
  autoconf automake libtool libltdl-dev autoconf-archive pkg-config protobuf-compiler
  dpkg-dev curl ca-certificates make gcc binutils file iproute2 xz-utils openssl)
# Not systemd-boot: its first install runs `bootctl install` on the host's
# EFI system partition, if it has one, replacing the host's own boot
# loader. The image's boot loader and stub come from the tools tree and a
# downloaded systemd-boot-efi package (scripts/image-lib.sh).
bp_pkgs=(mkosi systemd systemd-boot-efi systemd-container python3-virt-firmware
  qemu-system-x86 qemu-utils)

missing=()
for p in "${host_pkgs[@]}" "${bp_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
# The backports must be at their backports versions (mkosi 24, systemd 254, QEMU 10).
mkosi_ver=$(dpkg-query -W -f='${Version}' mkosi 2>/dev/null || true)
case "$mkosi_ver" in 24*|25*|26*) ;; *) missing+=(mkosi) ;; esac

if [ ${#missing[@]} -gt 0 ] || [ "${stale:-0}" = 1 ]; then
  echo "deps: installing ${missing[*]:-(refresh)}"
  "${APT[@]}" update
  "${APT[@]}" install --no-install-recommends "${host_pkgs[@]}"
  "${APT[@]}" install --no-install-recommends -t bookworm-backports "${bp_pkgs[@]}"
fi

if ! command -v cargo >/dev/null; then
  echo "deps: cargo not found; install Rust with rustup (the toolchain is pinned in rust-toolchain.toml), then run this again" >&2
  exit 1
fi
if command -v rustup >/dev/null; then
  rustup target list --installed | grep -qx x86_64-unknown-linux-musl ||
    rustup target add x86_64-unknown-linux-musl
  rustup component list --installed | grep -q '^clippy' || rustup component add clippy rustfmt
fi
echo "deps: host ready"
