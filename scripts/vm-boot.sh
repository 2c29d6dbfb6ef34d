#!/usr/bin/env bash
# Boots the built image under QEMU (TCG) + OVMF + swtpm, as many times as
# asked, and for each boot: times VM start -> "keel-agent: ready" on the
# serial console, reads the PCR lines the agent logs, and compares PCRs 4,
# 9 and 11 with keel-measure's prediction from the UKI file.
#
# Usage: scripts/vm-boot.sh [-n BOOTS] [-j PARALLEL] [-t TIMEOUT_S] [-c NODE_CONFIG] [IMAGE_DIR]
#   IMAGE_DIR defaults to build/image (keel.raw, keel.efi).
# Exit status 0 only if every boot reached "ready" and every PCR matched.
set -euo pipefail
source "$(dirname "$0")/image-lib.sh"

boots=1 parallel=1 timeout=300 config=
while getopts "n:j:t:c:" opt; do
  case $opt in
    n) boots=$OPTARG ;; j) parallel=$OPTARG ;; t) timeout=$OPTARG ;; c) config=$(realpath "$OPTARG") ;;
    *) die "usage: $0 [-n BOOTS] [-j PARALLEL] [-t TIMEOUT_S] [-c NODE_CONFIG] [IMAGE_DIR]" ;;
  esac
done
shift $((OPTIND - 1))
image_dir=$(realpath "${1:-$KEEL_IMAGE_OUT}")
raw=$image_dir/keel.raw uki=$image_dir/keel.efi
[ -f "$raw" ] && [ -f "$uki" ] || die "no built image in $image_dir: run scripts/image-build.sh"

ovmf_code=/usr/share/OVMF/OVMF_CODE_4M.fd ovmf_vars=/usr/share/OVMF/OVMF_VARS_4M.fd
for f in "$ovmf_code" "$ovmf_vars"; do [ -f "$f" ] || die "$f missing (install ovmf)"; done
command -v swtpm >/dev/null || die "swtpm missing (scripts/deps.sh)"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 missing (scripts/deps.sh)"

# KVM is detected, not assumed: the nested /dev/kvm here fails inside OVMF.
accel=tcg
if [ "${KEEL_VM_KVM:-0}" = 1 ] && [ -w /dev/kvm ]; then accel=kvm; fi

run_dir=$KEEL_BUILD/vm
rm -rf "$run_dir"
mkdir -p "$run_dir"

log "predicting PCRs from $uki"
measure_bin=$(measure_tool)
"$measure_bin" --uki "$uki" --output "$run_dir/measurements.json"

# One boot: $1 = index. Writes $dir/result: milliseconds to ready, or "timeout".
boot() {
  local dir=$run_dir/boot$1
  mkdir -p "$dir/tpm"
  cp "$ovmf_vars" "$dir/vars.fd"
  truncate -s 256M "$dir/state.raw"
  swtpm socket --tpm2 --tpmstate dir="$dir/tpm" \
    --ctrl type=unixio,path="$dir/swtpm.sock" --terminate \
    --log file="$dir/swtpm.log" &
  local swtpm_pid=$!
  for _ in $(seq 50); do [ -S "$dir/swtpm.sock" ] && break; sleep 0.1; done
  local fwcfg=()
  [ -n "$config" ] && fwcfg=(-fw_cfg "name=opt/keel/node-config,file=$config")
  local start
  start=$(date +%s%N)
  qemu-system-x86_64 -machine q35 -accel "$accel" -cpu max -smp 2 -m 2048 \
    -display none -monitor none -parallel none -no-reboot -nic none \
    -serial "file:$dir/serial.log" \
    -drive if=pflash,format=raw,readonly=on,file="$ovmf_code" \
    -drive if=pflash,format=raw,file="$dir/vars.fd" \
    -chardev socket,id=chrtpm,path="$dir/swtpm.sock" \
    -tpmdev emulator,id=tpm0,chardev=chrtpm -device tpm-tis,tpmdev=tpm0 \
    -drive if=none,id=os,file="$raw",format=raw,snapshot=on \
    -device virtio-blk-pci,drive=os,bootindex=1 \
    -drive if=none,id=state,file="$dir/state.raw",format=raw \
    -device virtio-blk-pci,drive=state \
    "${fwcfg[@]}" ${KEEL_VM_QEMU_ARGS:-} >"$dir/qemu.log" 2>&1 &
  local qemu_pid=$!
  local result=timeout
  while kill -0 "$qemu_pid" 2>/dev/null; do
    if grep -q 'keel-agent: ready' "$dir/serial.log" 2>/dev/null; then
      result=$(( ($(date +%s%N) - start) / 1000000 ))
      break
    fi
    if (( $(date +%s%N) - start > timeout * 1000000000 )); then break; fi
    sleep 0.1
  done
  sleep 0.5 # let the PCR lines printed before "ready" flush
  kill "$qemu_pid" 2>/dev/null || true
  wait "$qemu_pid" 2>/dev/null || true
  kill "$swtpm_pid" 2>/dev/null || true
  wait "$swtpm_pid" 2>/dev/null || true
  echo "$result" >"$dir/result"
}

log "booting $boots time(s), $parallel at a time ($accel)"
for ((i = 1; i <= boots; i++)); do
  boot "$i" &
  if (( i % parallel == 0 )); then wait; fi
done
wait

python3 - "$run_dir" "$boots" <<'PY'
import json, re, statistics, sys
run_dir, boots = sys.argv[1], int(sys.argv[2])
expected = json.load(open(f"{run_dir}/measurements.json"))
ok, times = True, []
for i in range(1, boots + 1):
    d = f"{run_dir}/boot{i}"
    result = open(f"{d}/result").read().strip()
    serial = open(f"{d}/serial.log", errors="replace").read()
    pcrs = dict(re.findall(r"pcr (\d+) sha256:([0-9a-f]{64})", serial))
    if result == "timeout":
        print(f"boot {i}: no 'keel-agent: ready' (serial log: {d}/serial.log)")
        ok = False
        continue
    times.append(int(result) / 1000)
    line = [f"boot {i}: ready after {times[-1]:.1f} s"]
    for pcr, want in expected.items():
        got = pcrs.get(pcr)
        if got == want["expected"]:
            line.append(f"pcr {pcr} ok")
        else:
            line.append(f"pcr {pcr} MISMATCH (booted {got}, predicted {want['expected']})")
            ok = False
    print("; ".join(line))
for pcr, want in expected.items():
    print(f"pcr {pcr} predicted {want['expected']}")
if times:
    print(f"VM start -> agent ready: median {statistics.median(times):.1f} s over {len(times)} boot(s) "
          f"(min {min(times):.1f}, max {max(times):.1f})")
sys.exit(0 if ok and len(times) == boots else 1)
PY
