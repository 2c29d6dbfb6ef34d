#!/usr/bin/env bash
# Checks that a binary is a stripped static-pie executable, runs it, and
# reports its size against the 8 MiB target (reported, not enforced).
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
size=$(stat -c %s "$bin")
target=$((8 * 1024 * 1024))
verdict=$([ "$size" -le "$target" ] && echo "within" || echo "OVER")
awk -v b="$bin" -v d="$desc" -v s="$size" -v v="$verdict" 'BEGIN {
  printf "agent: %s\n  %s\n  size: %d bytes (%.2f MiB; %s the 8 MiB target)\n", b, d, s, s / 1048576, v }'
"$bin" --version
