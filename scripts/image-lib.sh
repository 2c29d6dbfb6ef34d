# Shared helpers for the image scripts (sourced, not run).
# Paths are relative to the repository root; every output lives under build/.

KEEL_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KEEL_BUILD=${KEEL_BUILD:-$KEEL_ROOT/build}
KEEL_MKOSI_WORK=$KEEL_BUILD/mkosi          # generated sources, tools tree, staging
KEEL_IMAGE_OUT=${KEEL_IMAGE_OUT:-$KEEL_BUILD/image}
KEEL_PACKAGE_CACHE=${KEEL_PACKAGE_CACHE:-/var/cache/mkosi}
KEEL_AGENT_BIN=${KEEL_AGENT_BIN:-$KEEL_ROOT/target/x86_64-unknown-linux-musl/release/keel-agent}
KEEL_INITRD_BIN=${KEEL_INITRD_BIN:-$KEEL_ROOT/target/x86_64-unknown-linux-musl/release/keel-initrd}
APT_SOURCES=${APT_SOURCES:-/etc/apt/sources.list.d/debian.sources}

# What the image scripts create has the same modes whatever the caller's
# umask: a build on a machine with a stricter one gives the same image.
umask 022

log() { printf 'image: %s\n' "$*" >&2; }
die() { printf 'image: error: %s\n' "$*" >&2; exit 1; }

# Prints the deb822 stanza number $1 (0-based) of the machine's apt sources,
# with Types/Suites rewritten to $2/$3 (empty keeps the original line).
derive_stanza() {
  awk -v want="$1" -v types="$2" -v suites="$3" '
    /^[[:space:]]*$/ { if (seen) { n++; seen = 0 } ; next }
    /^#/ { next }
    { seen = 1 }
    n != want { next }
    /^Types:/  && types  != "" { print "Types: " types; next }
    /^Suites:/ && suites != "" { print "Suites: " suites; next }
    { print }
  ' "$APT_SOURCES"
}

# Index of the first stanza whose Suites line names a "-security" suite, or empty.
security_stanza() {
  awk '
    /^[[:space:]]*$/ { if (seen) { n++; seen = 0 } ; next }
    /^#/ { next }
    { seen = 1 }
    /^Suites:.*-security/ { print n; exit }
  ' "$APT_SOURCES"
}

# Writes mkosi package-manager trees (etc/apt/sources.list.d/mkosi.sources)
# for the image (bookworm) and the tools tree (trixie), derived from the
# machine's own apt configuration so that no mirror host is named in the repo.
generate_sources() {
  [ -f "$APT_SOURCES" ] || die "$APT_SOURCES not found: cannot derive package sources"
  local img=$KEEL_MKOSI_WORK/sources/image/etc/apt/sources.list.d
  local tools=$KEEL_MKOSI_WORK/sources/tools/etc/apt/sources.list.d
  mkdir -p "$img" "$tools"
  {
    derive_stanza 0 deb "bookworm bookworm-updates"
    local sec
    sec=$(security_stanza)
    if [ -n "$sec" ]; then
      printf '\n'
      derive_stanza "$sec" deb bookworm-security
    fi
  } >"$img/mkosi.sources.new"
  derive_stanza 0 deb "trixie" >"$tools/mkosi.sources.new"
  grep -q '^URIs:' "$img/mkosi.sources.new" || die "no URIs line in the first stanza of $APT_SOURCES"
  mv "$img/mkosi.sources.new" "$img/mkosi.sources"
  mv "$tools/mkosi.sources.new" "$tools/mkosi.sources"
}

# SOURCE_DATE_EPOCH: the commit time, so two builds of one commit agree.
source_date_epoch() {
  if [ -n "${SOURCE_DATE_EPOCH:-}" ]; then
    echo "$SOURCE_DATE_EPOCH"
  elif t=$(git -C "$KEEL_ROOT" log -1 --format=%ct 2>/dev/null) && [ -n "$t" ]; then
    echo "$t"
  else
    echo 1735689600 # 2025-01-01T00:00:00Z, before the first commit exists
  fi
}

# The static agent binary, built here if the TPM libraries are ready, and
# the static initrd binary (it needs no C libraries).
ensure_agent() {
  if [ ! -x "$KEEL_AGENT_BIN" ]; then
    if [ "$KEEL_AGENT_BIN" = "$KEEL_ROOT/target/x86_64-unknown-linux-musl/release/keel-agent" ] &&
      compgen -G "$KEEL_ROOT/target/musl-sysroot/.stamp-*" >/dev/null; then
      log "building the agent (cargo build --release --locked -p keel-agent)"
      "$KEEL_ROOT/scripts/build-paths.sh"
      (cd "$KEEL_ROOT" && cargo build --release --locked -p keel-agent --bin keel-agent) ||
        die "building the agent failed"
      "$KEEL_ROOT/scripts/check-static.sh" "$KEEL_AGENT_BIN" >&2 || die "the agent fails its checks"
    else
      die "agent binary $KEEL_AGENT_BIN is missing: run 'make agent' first (it needs the static TPM libraries from scripts/build-tss.sh)"
    fi
  fi
  if [ ! -x "$KEEL_INITRD_BIN" ]; then
    [ "$KEEL_INITRD_BIN" = "$KEEL_ROOT/target/x86_64-unknown-linux-musl/release/keel-initrd" ] ||
      die "initrd binary $KEEL_INITRD_BIN is missing"
    log "building the initrd's init (cargo build --release --locked -p keel-initrd)"
    "$KEEL_ROOT/scripts/build-paths.sh"
    (cd "$KEEL_ROOT" && cargo build --release --locked -p keel-initrd) || die "building keel-initrd failed"
    "$KEEL_ROOT/scripts/check-static.sh" "$KEEL_INITRD_BIN" >&2 || die "keel-initrd fails its checks"
  fi
  # The image carries no libraries for either: an ELF must be static.
  local bin
  for bin in "$KEEL_AGENT_BIN" "$KEEL_INITRD_BIN"; do
    if file -b "$bin" | grep -q '^ELF' && ! file -b "$bin" | grep -q 'static'; then
      die "$bin is not statically linked"
    fi
  done
}

# The files the image takes from the checkout (mkosi.extra) got their modes
# from the umask of whoever cloned it. They are set as a clone under umask
# 022 has them: owner rw, group and others r, and x for all where git
# records an executable.
normalize_checkout_modes() {
  chmod -R u=rwX,go=rX "$KEEL_ROOT/mkosi/mkosi.extra"
}

# Assembles the tree mkosi overlays onto the image root: the agent, the
# stub, the empty mount points the agent bind-mounts state-disk directories
# over, the directories Kubernetes expects on the read-only root (git keeps
# no empty directories) and, for experiments, KEEL_EXTRA_TREE.
#
# FLEXVOLUME_DIR: the kubelet's and kube-controller-manager's volume plugin
# directory. kubeadm gives the controller manager a hostPath volume of it
# (DirectoryOrCreate) and the kubelet creates it at start; neither can
# create it on the erofs root.
FLEXVOLUME_DIR=usr/libexec/kubernetes/kubelet-plugins/volume/exec
stage_agent() { # $1 = tree directory
  rm -rf "$1"
  install -D -m 0755 "$KEEL_AGENT_BIN" "$1/usr/bin/keel-agent"
  install -d -m 0755 "$1/etc/kubernetes" "$1/etc/cni/net.d" "$1/opt/cni" "$1/opt/kubernetes" \
    "$1/$FLEXVOLUME_DIR"
  install -D -m 0644 "$KEEL_MKOSI_WORK/packages/unpacked/usr/lib/systemd/boot/efi/linuxx64.efi.stub" \
    "$1/usr/lib/systemd/boot/efi/linuxx64.efi.stub"
  if [ -n "${KEEL_EXTRA_TREE:-}" ]; then
    cp -a "$KEEL_EXTRA_TREE/." "$1/"
  fi
}

# The trixie tools tree, built once and shared by every image build.
ensure_tools_tree() {
  local dir=$KEEL_MKOSI_WORK/tools
  local stamp=$dir/.stamp-$(sha256sum "$KEEL_ROOT/mkosi/tools/mkosi.conf" | cut -c1-16)
  if [ -f "$stamp" ] && [ -x "$dir/tools/usr/bin/systemd-repart" ]; then
    return
  fi
  log "building the tools tree (Debian trixie) into $dir"
  rm -rf "$dir"
  mkdir -p "$dir" "$KEEL_MKOSI_WORK/workspace"
  mkosi \
    --directory "$KEEL_ROOT/mkosi/tools" \
    --package-manager-tree "$KEEL_MKOSI_WORK/sources/tools" \
    --output-dir "$dir" \
    --workspace-dir "$KEEL_MKOSI_WORK/workspace" \
    --package-cache-dir "$KEEL_PACKAGE_CACHE" \
    --force \
    build >"$dir.log" 2>&1 || { tail -40 "$dir.log" >&2; die "tools tree build failed (log: $dir.log)"; }
  touch "$stamp"
}

# The systemd-stub the UKI is built from: systemd-boot-efi 254 from
# bookworm-backports (bookworm's 252 stub with a newer ukify yields
# overlapping PE sections). Fetched with the host's apt (scripts/deps.sh
# configures bookworm-backports); only the stub file goes into the image
# tree, where mkosi looks for it.
ensure_stub_package() {
  local dir=$KEEL_MKOSI_WORK/packages
  mkdir -p "$dir"
  if ! compgen -G "$dir/systemd-boot-efi_254*_amd64.deb" >/dev/null; then
    log "fetching systemd-boot-efi from bookworm-backports"
    (cd "$dir" && apt-get download -q 'systemd-boot-efi/bookworm-backports') >&2 ||
      die "apt-get download systemd-boot-efi/bookworm-backports failed (run scripts/deps.sh)"
  fi
  rm -rf "$dir/unpacked"
  dpkg-deb -x "$(compgen -G "$dir/systemd-boot-efi_254*_amd64.deb" | head -1)" "$dir/unpacked"
}

# mkosi with the options every image build shares, for SOURCE_DATE_EPOCH $1.
image_mkosi() { # $1 = epoch, then mkosi's further options and verb
  local epoch=$1
  shift
  mkosi \
    --directory "$KEEL_ROOT/mkosi" \
    --tools-tree "$KEEL_MKOSI_WORK/tools/tools" \
    --package-manager-tree "$KEEL_MKOSI_WORK/sources/image" \
    --workspace-dir "$KEEL_MKOSI_WORK/workspace" \
    --package-cache-dir "$KEEL_PACKAGE_CACHE" \
    --source-date-epoch "$epoch" \
    --force \
    "$@"
}

# The image root as its packages installed it, before the agent and
# mkosi.extra go in: mkosi's incremental cache. Installing the packages is
# most of an image build (about 36 s of 47 s); with the cache a build that
# changed only the agent or mkosi.extra copies the tree instead, and
# `make image-prepare` fills the cache while the binaries build.
#
# mkosi keys its cache on the package list and sources alone. This key adds
# the build's time stamp (package scripts write it into files, such as
# /etc/shadow's dates), mkosi's version and every config file mkosi reads
# before the cached step; a cache made under another key is deleted, so an
# image never takes packages installed for another commit or config. The
# result is the same bytes as a build without the cache: make image-repro
# builds both ways and compares.
IMAGE_CACHE=$KEEL_MKOSI_WORK/cache

image_cache_key() { # $1 = epoch
  {
    echo "epoch $1"
    mkosi --version
    (cd "$KEEL_ROOT" && find mkosi -path mkosi/mkosi.extra -prune -o -path mkosi/mkosi.repart -prune \
      -o -type f -print0 | sort -z | xargs -0 sha256sum)
    (cd "$KEEL_MKOSI_WORK/sources/image" && find . -type f -print0 | sort -z | xargs -0 sha256sum)
  } | sha256sum | cut -c1-16
}

# Prints mkosi's options for the cache (one per line) and drops a cache made
# under another key. Prints nothing with KEEL_IMAGE_INCREMENTAL=0.
image_cache_opts() { # $1 = epoch
  [ "${KEEL_IMAGE_INCREMENTAL:-1}" = 1 ] || return 0
  local key
  key=$(image_cache_key "$1")
  if [ "$(cat "$IMAGE_CACHE/key" 2>/dev/null)" != "$key" ]; then
    rm -rf "$IMAGE_CACHE"
    mkdir -p "$IMAGE_CACHE/tree"
    echo "$key" >"$IMAGE_CACHE/key"
  fi
  printf '%s\n' --incremental --cache-dir "$IMAGE_CACHE/tree"
}

# Fills the cache for epoch $1 unless it is filled: installs the packages
# and stops there (no output image).
ensure_image_cache() { # $1 = epoch
  local opts start
  mapfile -t opts < <(image_cache_opts "$1")
  [ "${#opts[@]}" -gt 0 ] || return 0
  [ -f "$IMAGE_CACHE/filled" ] && return 0
  log "installing the image's packages into the cache $IMAGE_CACHE"
  start=$(date +%s)
  rm -rf "$IMAGE_CACHE/none"
  image_mkosi "$1" "${opts[@]}" --format none --output-dir "$IMAGE_CACHE/none" build \
    >"$IMAGE_CACHE.log" 2>&1 || { tail -40 "$IMAGE_CACHE.log" >&2; die "installing the image's packages failed (log: $IMAGE_CACHE.log)"; }
  rm -rf "$IMAGE_CACHE/none"
  touch "$IMAGE_CACHE/filled"
  log "packages installed in $(( $(date +%s) - start )) s"
}

# Prints path, size and SHA-256 of each artifact in $1.
report_artifacts() {
  local out=$1 f
  printf '%-48s %12s  %s\n' artifact bytes sha256
  for f in "$out"/keel.raw "$out"/keel.efi "$out"/keel.*.raw; do
    [ -f "$f" ] || continue
    printf '%-48s %12s  %s\n' "$f" "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -d' ' -f1)"
  done
}
