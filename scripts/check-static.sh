#!/usr/bin/env bash
# Checks that a binary is a stripped static-pie executable and reports its size.
set -euo pipefail
bin=${1:?usage: check-static.sh BINARY}
desc=$(file -b "$bin")
case "$desc" in
  *static-pie*|*"statically linked"*) ;;
  *) echo "check-static: $bin is not statically linked: $desc" >&2; exit 1 ;;
esac
if ldd "$bin" >/dev/null 2>&1 && ! ldd "$bin" 2>&1 | grep -q 'statically linked'; then
  echo "check-static: ldd resolves dynamic dependencies of $bin" >&2; exit 1
fi
size=$(stat -c %s "$bin")
max=$((8 * 1024 * 1024))
awk -v b="$bin" -v d="$desc" -v s="$size" 'BEGIN { printf "agent: %s\n  %s\n  size: %d bytes (%.2f MiB, limit 8 MiB)\n", b, d, s, s / 1048576 }'
[ "$size" -le "$max" ] || { echo "check-static: $bin exceeds 8 MiB" >&2; exit 1; }
"$bin" --version
