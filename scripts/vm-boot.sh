#!/usr/bin/env bash
# Boots the built image under QEMU + OVMF + swtpm and checks it, through the
# test tests/tests/image_pcrs.rs (crate keel-e2e): it predicts PCRs 4, 9 and
# 11 from the UKI and PCR 12 from tests/fixtures/node-config.json, boots the
# image BOOTS times with that config passed by fw_cfg, compares the PCRs
# the agent prints, checks that the agent's startup measurements replay, and
# reports the median time from VM start to "keel-agent: ready"; then boots a
# copy of the disk with one byte of the root changed, which the initrd must
# refuse (dm-verity) and power off.
#
# Usage: scripts/vm-boot.sh [-n BOOTS] [-t PATIENCE_S] [IMAGE_DIR]
#   IMAGE_DIR defaults to build/image. Each boot's serial log (with arrival
#   times), QEMU log and TPM state are kept in build/vm/bootN/.
# Env:   KEEL_VM_ACCEL=kvm|tcg forces the accelerator (default: KVM if a
#        probe VM boots with it, else TCG).
#        KEEL_VM_CPU=MODEL is QEMU's CPU model under TCG (default: max).
# Exit status 0 only if every boot reached "ready" with the predicted PCRs.
set -euo pipefail
source "$(dirname "$0")/image-lib.sh"

boots=1 patience=600
while getopts "n:t:" opt; do
  case $opt in
    n) boots=$OPTARG ;; t) patience=$OPTARG ;;
    *) die "usage: $0 [-n BOOTS] [-t PATIENCE_S] [IMAGE_DIR]" ;;
  esac
done
shift $((OPTIND - 1))
image_dir=$(realpath -m "${1:-$KEEL_IMAGE_OUT}")
[ -f "$image_dir/keel.raw" ] && [ -f "$image_dir/keel.efi" ] ||
  die "no built image in $image_dir: run 'make image'"
for tool in qemu-system-x86_64 swtpm swtpm_setup; do
  command -v "$tool" >/dev/null || die "$tool missing (scripts/deps.sh)"
done
[ -f /usr/share/OVMF/OVMF_CODE.fd ] || die "OVMF missing (scripts/deps.sh installs ovmf)"

run_dir=$KEEL_BUILD/vm
rm -rf "$run_dir"
mkdir -p "$run_dir"
log "booting $image_dir $boots time(s); logs in $run_dir"
cd "$KEEL_ROOT"
KEEL_IMAGE_DIR=$image_dir KEEL_VM_BOOTS=$boots KEEL_VM_PATIENCE_S=$patience KEEL_VM_WORK=$run_dir \
  cargo test --locked -p keel-e2e --test image_pcrs -- --nocapture --test-threads=1
