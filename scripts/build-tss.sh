#!/usr/bin/env bash
# Builds the static C stack the agent links for x86_64-unknown-linux-musl:
# Mbed TLS's libmbedcrypto (the ESYS crypto backend) and tpm2-tss 4.1.3, both
# from Debian's source packages. Mbed TLS rather than OpenSSL: ESYS needs only
# hashes, HMAC, AES-CFB, RSA-OAEP, ECDH and a DRBG, and libcrypto's provider
# tables pull in every algorithm it has (about 2 MiB of the agent).
# Output: $TSS_PREFIX (default target/musl-sysroot), reused when its stamp
# matches. The apt source is derived from the machine's own.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
prefix=${TSS_PREFIX:-$top/target/musl-sysroot}
# tpm2-tss is built from its upstream tarball alone, which every Debian
# revision of one upstream version shares: the revision the archive has is
# taken (it keeps only the current one), and it must be of this version.
tss_version=4.1.3
# Mbed TLS 3.6 is the long-term-support branch; the newest Debian revision of
# it is taken, so a stable update never leaves the build without a source.
mbed_branch=3.6
# The local changes to tpm2-tss (below) are part of the stamp.
patches=cloexec1
stamp="$prefix/.stamp-tss-$tss_version-$patches-mbedtls-$mbed_branch"
[ -f "$stamp" ] && { echo "tss: cached in $prefix"; exit 0; }

work="$top/target/tss-build"
rm -rf "$work"
mkdir -p "$work" "$prefix/lib" "$prefix/include"
# Log each step; show the log of a failed step.
run() { local log="$work/step.log"; "$@" >"$log" 2>&1 || { tail -40 "$log" >&2; echo "tss: failed: $*" >&2; exit 1; }; }

# musl-gcc ships no kernel headers: expose the host's through -idirafter.
khdr="$work/kernel-headers"
mkdir -p "$khdr"
ln -s /usr/include/linux "$khdr/linux"
ln -s /usr/include/asm-generic "$khdr/asm-generic"
ln -s /usr/include/x86_64-linux-gnu/asm "$khdr/asm"
# Sections per function and object, so the agent's link drops what is unused.
cflags="-Os -fPIC -ffunction-sections -fdata-sections"

echo "tss: fetching tpm2-tss $tss_version and mbedtls $mbed_branch sources"
apt_dir="$work/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/sources.list.d"
awk '/^[[:space:]]*$/ { if (seen) exit; next } /^#/ { next } { seen = 1 }
     /^Types:/ { print "Types: deb-src"; next }
     /^Suites:/ { print "Suites: trixie"; next } { print }' \
  /etc/apt/sources.list.d/debian.sources >"$apt_dir/sources.list.d/trixie-src.sources"
apt_opts=(-o Dir::Etc::SourceList=/dev/null
  -o "Dir::Etc::SourceParts=$apt_dir/sources.list.d"
  -o "Dir::State::Lists=$apt_dir/lists"
  -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache= -q)
apt-get "${apt_opts[@]}" update >/dev/null
(cd "$work" && run apt-get "${apt_opts[@]}" source --download-only tpm2-tss mbedtls)

tss_dsc=$(compgen -G "$work/tpm2-tss_*.dsc" | head -n1) ||
  { echo "tss: no tpm2-tss source package was fetched" >&2; exit 1; }
tss_debver=${tss_dsc##*/tpm2-tss_}
tss_debver=${tss_debver%.dsc}
tss_tar="$work/tpm2-tss_${tss_version}.orig.tar.gz"
[ "${tss_debver%-*}" = "$tss_version" ] ||
  { echo "tss: Debian's tpm2-tss $tss_debver is not of upstream $tss_version" >&2; exit 1; }
[ -f "$tss_tar" ] ||
  { echo "tss: Debian's tpm2-tss $tss_debver has no ${tss_tar##*/}" >&2; exit 1; }

mbed_tar=$(compgen -G "$work/mbedtls_*.orig.tar.*" | head -n1) ||
  { echo "tss: no mbedtls source tarball was fetched" >&2; exit 1; }
mbed_version=${mbed_tar##*/mbedtls_}
mbed_version=${mbed_version%.orig.tar.*}
case "$mbed_version" in
  "$mbed_branch".*) ;;
  *) echo "tss: mbedtls $mbed_version is not on the $mbed_branch branch" >&2; exit 1 ;;
esac
tar -C "$work" -xf "$mbed_tar"
mbed="$work/mbedtls-$mbed_version"

echo "tss: compiling mbedtls $mbed_version (libmbedcrypto)"
run make -C "$mbed/library" -j"$(nproc)" CC=musl-gcc AR=ar \
  CFLAGS="$cflags -idirafter $khdr" libmbedcrypto.a
cp "$mbed/library/libmbedcrypto.a" "$prefix/lib/"
rm -rf "$prefix/include/mbedtls" "$prefix/include/psa"
cp -r "$mbed/include/mbedtls" "$mbed/include/psa" "$prefix/include/"

tar -C "$work" -xf "$tss_tar"
src="$work/tpm2-tss-$tss_version"

# Every descriptor tpm2-tss opens is close-on-exec. Upstream opens the TPM
# device and its sockets without it, so a program the agent runs (kubeadm,
# cryptsetup) would inherit the TPM connection: through the resource
# manager, its loaded keys; and the swtpm TCTI, which connects for every
# command, would leave swtpm serving a socket a child still holds, never
# answering the next one.
echo "tss: patching tpm2-tss $tss_version (close-on-exec)"
sed -i 's/socket (\(.*\), SOCK_STREAM, 0)/socket (\1, SOCK_STREAM | SOCK_CLOEXEC, 0)/' \
  "$src/src/util-io/io.c"
sed -i 's/open (pathname, O_RDWR | O_NONBLOCK/open (pathname, O_RDWR | O_NONBLOCK | O_CLOEXEC/' \
  "$src/src/tss2-tcti/tcti-device.c"
[ "$(grep -c 'SOCK_STREAM | SOCK_CLOEXEC' "$src/src/util-io/io.c")" = 2 ] &&
  [ "$(grep -c 'O_NONBLOCK | O_CLOEXEC' "$src/src/tss2-tcti/tcti-device.c")" = 2 ] ||
  { echo "tss: the close-on-exec patch no longer applies to tpm2-tss $tss_version" >&2; exit 1; }

echo "tss: configuring tpm2-tss $tss_version"
cd "$src"
echo "$tss_version" >VERSION
sed -i '/git describe/d' bootstrap
run ./bootstrap
CC=musl-gcc \
CFLAGS="$cflags" \
CPPFLAGS="-idirafter $khdr -I$prefix/include" \
LDFLAGS="-L$prefix/lib" \
run ./configure --prefix="$prefix" --disable-shared --enable-static --with-pic \
  --enable-nodl --with-crypto=mbed --disable-fapi --disable-policy \
  --disable-vendor --disable-doxygen-doc --disable-weakcrypto \
  --disable-tcti-pcap --disable-tcti-libtpms --disable-tcti-cmd \
  --disable-tcti-spi-helper --disable-tcti-spi-ltt2go --disable-tcti-spi-ftdi \
  --disable-tcti-i2c-helper --disable-tcti-i2c-ftdi \
  --disable-unit --disable-integration --without-udevrulesdir \
  --with-runstatedir=/run --with-sysusersdir=/tmp/ignored --with-tmpfilesdir=/tmp/ignored

echo "tss: compiling tpm2-tss"
run make -j"$(nproc)"
run make install

lib="$prefix/lib"
# The TCTI loader links the TCTIs directly (--enable-nodl): say so to pkg-config.
sed -i 's/^Requires.private:.*$//' "$lib/pkgconfig/tss2-tctildr.pc"
echo "Requires.private: tss2-tcti-device tss2-tcti-mssim tss2-tcti-swtpm tss2-mu" \
  >>"$lib/pkgconfig/tss2-tctildr.pc"
# Each TCTI archive defines Tss2_Tcti_Info; keep them from colliding.
for t in device mssim swtpm; do
  objcopy --localize-symbol=Tss2_Tcti_Info "$lib/libtss2-tcti-$t.a"
done
# A libcrypto left by an earlier OpenSSL-backed build must not be linked.
rm -rf "$lib/libcrypto.a" "$lib/pkgconfig/libcrypto.pc" "$prefix/include/openssl" "$prefix/openssl"
rm -f "$prefix"/.stamp-tss-*
touch "$stamp"
rm -rf "$work"
# tss-esapi-sys caches the library list pkg-config gave it and bundles the
# archives: drop its build outputs so the next cargo build probes these.
if [ -d "$top/target/x86_64-unknown-linux-musl" ]; then
  (cd "$top" && for p in --profile=dev --release; do cargo clean -q -p tss-esapi-sys "$p"; done)
fi
echo "tss: installed in $prefix (tpm2-tss $tss_version from Debian $tss_debver, mbedtls $mbed_version)"
