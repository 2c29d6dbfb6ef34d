#!/usr/bin/env bash
# Builds the static C stack the agent links for x86_64-unknown-linux-musl:
# OpenSSL libcrypto (openssl-src crate) and tpm2-tss 4.1.3 (Debian's source
# package). Output: $TSS_PREFIX (default target/musl-sysroot), reused when
# its stamp matches. The apt source is derived from the machine's own.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
prefix=${TSS_PREFIX:-$top/target/musl-sysroot}
tss_version=4.1.3
tss_debver=4.1.3-1.2
stamp="$prefix/.stamp-tss-$tss_debver-openssl-300.6.1"
[ -f "$stamp" ] && { echo "tss: cached in $prefix"; exit 0; }

work="$top/target/tss-build"
rm -rf "$work"
mkdir -p "$work" "$prefix"
# Log each step; show the log of a failed step.
run() { local log="$work/step.log"; "$@" >"$log" 2>&1 || { tail -40 "$log" >&2; echo "tss: failed: $*" >&2; exit 1; }; }

# musl-gcc ships no kernel headers: expose the host's through -idirafter.
khdr="$work/kernel-headers"
mkdir -p "$khdr"
ln -s /usr/include/linux "$khdr/linux"
ln -s /usr/include/asm-generic "$khdr/asm-generic"
ln -s /usr/include/x86_64-linux-gnu/asm "$khdr/asm"

ssl="$prefix/openssl/install"
if [ ! -f "$ssl/lib/libcrypto.a" ]; then
  echo "tss: building OpenSSL (libcrypto) for musl"
  (
    cd "$top/scripts/openssl-musl"
    CC_x86_64_unknown_linux_musl=musl-gcc \
    CFLAGS_x86_64_unknown_linux_musl="-idirafter $khdr" \
    KEEL_OPENSSL_PREFIX="$prefix/openssl" \
      cargo build -q --release --target x86_64-unknown-linux-musl \
        --target-dir "$work/openssl-target"
  )
fi
[ -f "$ssl/lib/libcrypto.a" ] || { echo "tss: libcrypto.a missing" >&2; exit 1; }

echo "tss: fetching tpm2-tss $tss_debver source"
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
(cd "$work" && apt-get "${apt_opts[@]}" source --download-only "tpm2-tss=$tss_debver" >/dev/null)
tar -C "$work" -xf "$work"/tpm2-tss_${tss_version}.orig.tar.gz
src="$work/tpm2-tss-$tss_version"

echo "tss: configuring tpm2-tss $tss_version"
cd "$src"
echo "$tss_version" >VERSION
sed -i '/git describe/d' bootstrap
run ./bootstrap
CC=musl-gcc \
CPPFLAGS="-idirafter $khdr -I$ssl/include" \
LDFLAGS="-L$ssl/lib" \
PKG_CONFIG_PATH="$ssl/lib/pkgconfig" \
CRYPTO_CFLAGS="-I$ssl/include" CRYPTO_LIBS="-L$ssl/lib -lcrypto" \
run ./configure --prefix="$prefix" --disable-shared --enable-static --with-pic \
  --enable-nodl --with-crypto=ossl --disable-fapi --disable-policy \
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
# libcrypto lives beside the TSS libraries so pkg-config finds one prefix.
cp "$ssl/lib/libcrypto.a" "$lib/"
mkdir -p "$prefix/include"
cp -r "$ssl/include/openssl" "$prefix/include/"
cat >"$lib/pkgconfig/libcrypto.pc" <<PC
prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include
Name: libcrypto
Description: OpenSSL cryptography library (static, musl)
Version: 3.6.3
Libs: -L\${libdir} -lcrypto
Cflags: -I\${includedir}
PC
touch "$stamp"
rm -rf "$work"
echo "tss: installed in $prefix"
