#!/usr/bin/env bash
# Checks that a binary is a stripped static-pie executable that embeds no
# path of the machine that built it (scripts/build-paths.sh), runs it, and
# fails when it is larger than the 8 MiB target (KEEL_AGENT_MAX_BYTES).
set -euo pipefail
bin=${1:?usage: check-static.sh BINARY}
desc=$(file -b "$bin")
case "$desc" in
  *static-pie*|*"statically linked"*) ;;
  *) echo "check-static: $bin is not statically linked: $desc" >&2; exit 1 ;;
esac
case "$desc" in
  *stripped*) ;;
  *) echo "check-static: $bin is not stripped: $desc" >&2; exit 1 ;;
esac
if ldd "$bin" >/dev/null 2>&1 && ! ldd "$bin" 2>&1 | grep -q 'statically linked'; then
  echo "check-static: ldd resolves dynamic dependencies of $bin" >&2; exit 1
fi
# A build path in the binary makes its bytes, and the image's PCRs, depend on
# where the checkout and cargo's home are. What rustc would embed: sources
# generated under the checkout's target/, and the dependencies' sources under
# cargo's home; each as given and with symlinks resolved.
root=$(CDPATH='' cd -- "$(dirname -- "$0")/.." && pwd)
home=${CARGO_HOME:-${HOME:-/root}/.cargo}
patterns=()
for dir in "$root" "$home" ${CARGO_TARGET_DIR:+"$CARGO_TARGET_DIR"}; do
  physical=$(CDPATH='' cd -- "$dir" 2>/dev/null && pwd -P) || physical=$dir
  for form in "$dir" "$physical"; do
    case "$dir" in
      "$root") patterns+=("$form/target/") ;;
      "$home") patterns+=("$form/registry/" "$form/git/") ;;
      *) patterns+=("$form/") ;;
    esac
  done
done
for pattern in "${patterns[@]}"; do
  if n=$(grep -a -o -F -- "$pattern" "$bin" | wc -l) && [ "$n" -gt 0 ]; then
    echo "check-static: $bin embeds the build path $pattern $n times, so a build elsewhere" \
      "gives other bytes; run scripts/build-paths.sh (make tss) and rebuild, without RUSTFLAGS" \
      "(it replaces the flags .cargo/config.toml sets)" >&2
    exit 1
  fi
done
size=$(stat -c %s "$bin")
target=${KEEL_AGENT_MAX_BYTES:-$((8 * 1024 * 1024))}
case "$target" in
  ''|*[!0-9]*) echo "check-static: KEEL_AGENT_MAX_BYTES must be a byte count" >&2; exit 1 ;;
esac
verdict=$([ "$size" -le "$target" ] && echo "within" || echo "OVER")
awk -v b="$bin" -v d="$desc" -v s="$size" -v t="$target" -v v="$verdict" 'BEGIN {
  printf "%s\n  %s\n  size: %d bytes (%.2f MiB; %s the %.2f MiB target)\n",
    b, d, s, s / 1048576, v, t / 1048576 }'
"$bin" --version
if [ "$size" -gt "$target" ]; then
  echo "check-static: $bin is $size bytes, $((size - target)) over the $target-byte size target;" \
    "see what grew with 'cargo bloat --release -p keel-agent --bin keel-agent --crates'" >&2
  exit 1
fi
