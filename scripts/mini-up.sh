#!/usr/bin/env bash
# A local confidential cluster: one control-plane VM and one worker VM of the
# built keel image under QEMU + OVMF, each with its own swtpm (EK certificate
# from a project-owned CA under build/mini/), a blank second disk as its
# state disk, and QEMU user networking. The operator side runs here: the
# component mirror (stand-in kubeadm/kubelet/kubectl, CNI plugins, crictl) on
# 127.0.0.1, reached from the guests as 10.0.2.2, and `keel init` over aTLS.
#
# Networking: each VM is 10.0.2.15 behind its own user-net NAT and the host
# is 10.0.2.2 from inside. VMs cannot reach each other, so the worker reaches
# the control plane's join service through the host: a host loopback port is
# forwarded to the control plane's join port, and the cluster config names
# 10.0.2.2:<that port> as the control-plane endpoint. Nothing leaves this
# machine.
#
# Usage: scripts/mini-up.sh [--keep] [--no-build] [--e2e] [--patience SECONDS]
#   --e2e       after the cluster is up, run the end-to-end scenarios on it
#               (a second init, a node with another config, a node with a
#               changed image, a worker reboot and rejoin, the state disk)
#   --keep      leave the VMs, swtpm and the mirror running (stop them with
#               scripts/mini-up.sh --down)
#   --no-build  use build/image and the host tools as they are
#   --down      stop what a --keep run left running
# Env: KEEL_IMAGE_DIR  the image to boot (default build/image)
#      KEEL_VM_ACCEL=kvm|tcg forces the accelerator (default: KVM if a
#      probe VM reaches the firmware's boot manager with it, else TCG).
# Output: build/mini/ (configs, measurements, serial logs, workspace).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MINI=$ROOT/build/mini
IMAGE=${KEEL_IMAGE_DIR:-$ROOT/build/image}
TARGET_DIR=$ROOT/target/x86_64-unknown-linux-musl/debug
OVMF_CODE=/usr/share/OVMF/OVMF_CODE.fd
OVMF_VARS=/usr/share/OVMF/OVMF_VARS.fd
GUEST_INIT_PORT=9000
GUEST_JOIN_PORT=9090

keep=0 build=1 patience=600 down=0 e2e=0
while [ $# -gt 0 ]; do
  case $1 in
    --keep) keep=1 ;;
    --no-build) build=0 ;;
    --patience) patience=$2; shift ;;
    --down) down=1 ;;
    --e2e) e2e=1 ;;
    *) echo "usage: $0 [--keep] [--no-build] [--patience SECONDS] | --down" >&2; exit 2 ;;
  esac
  shift
done

log() { printf 'mini: %s\n' "$*" >&2; }
die() { printf 'mini: error: %s\n' "$*" >&2; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# Every process started here is recorded in build/mini/pids and stopped by
# its own ID only.
stop_all() {
  [ -f "$MINI/pids" ] || return 0
  local pid
  while read -r pid; do
    kill "$pid" 2>/dev/null || true
  done <"$MINI/pids"
  sleep 0.5
  while read -r pid; do
    kill -9 "$pid" 2>/dev/null || true
  done <"$MINI/pids"
  rm -f "$MINI/pids"
}
track() { echo "$1" >>"$MINI/pids"; }

if [ "$down" = 1 ]; then
  stop_all
  log "stopped"
  exit 0
fi

cleanup() {
  local status=$?
  if [ "$keep" = 1 ] && [ "$status" = 0 ]; then
    log "--keep: running (pids in $MINI/pids); stop with $0 --down"
  else
    stop_all
  fi
  exit "$status"
}

t_total=$(now)
phases=()
phase_done() { phases+=("$(printf '%-28s %6s s' "$1" "$(since "$2")")"); }

# ---- build ---------------------------------------------------------------
t=$(now)
if [ "$build" = 1 ]; then
  log "building the agent and the image (cached when unchanged)"
  make -C "$ROOT" --no-print-directory agent image >&2
fi
log "building the host tools (keel, keel-measure, keel-standin, keel-mini-mirror)"
(cd "$ROOT" && cargo build --locked --quiet -p keel-cli --bin keel -p keel-image --bin keel-measure \
  -p keel-testkit --bin keel-standin --bin keel-mini-mirror) >&2
phase_done build "$t"
for f in keel.raw keel.efi; do
  [ -f "$IMAGE/$f" ] || die "no $IMAGE/$f: run 'make image'"
done
for tool in qemu-system-x86_64 swtpm swtpm_setup swtpm_localca; do
  command -v "$tool" >/dev/null || die "$tool missing (make deps)"
done
[ -f "$OVMF_CODE" ] || die "OVMF missing (make deps)"
IMAGE_DISK=$IMAGE/keel.raw

# ---- fresh run directory ---------------------------------------------------
stop_all
rm -rf "$MINI"
mkdir -p "$MINI"/{ca,workspace}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

accel() {
  case ${KEEL_VM_ACCEL:-} in
    kvm) echo kvm; return ;; tcg) echo tcg; return ;;
  esac
  if [ -w /dev/kvm ]; then
    # Nested KVM can fail inside the firmware: boot OVMF alone and look for
    # its boot manager.
    local probe=$MINI/kvm-probe.log
    timeout 15 qemu-system-x86_64 -machine q35 -accel kvm -cpu host -m 256 -nodefaults \
      -display none -no-reboot -serial "file:$probe" \
      -drive "if=pflash,format=raw,readonly=on,file=$OVMF_CODE" \
      -drive "if=pflash,format=raw,snapshot=on,file=$OVMF_VARS" >/dev/null 2>&1 || true
    if grep -q BdsDxe "$probe" 2>/dev/null; then echo kvm; return; fi
  fi
  echo tcg
}

# ---- EK CA and TPMs --------------------------------------------------------
t=$(now)
cat >"$MINI/ca/localca.conf" <<EOF
statedir = $MINI/ca
signingkey = $MINI/ca/signkey.pem
issuercert = $MINI/ca/issuercert.pem
certserial = $MINI/ca/certserial
EOF
cat >"$MINI/ca/setup.conf" <<EOF
create_certs_tool = /usr/bin/swtpm_localca
create_certs_tool_config = $MINI/ca/localca.conf
create_certs_tool_options = /etc/swtpm-localca.options
active_pcr_banks = sha256
EOF
manufacture() { # $1 = node directory
  mkdir -p "$1/tpm"
  swtpm_setup --tpm2 --create-ek-cert --create-platform-cert --lock-nvram --overwrite \
    --tpmstate "$1/tpm" --config "$MINI/ca/setup.conf" --logfile "$1/swtpm_setup.log" >/dev/null 2>&1 ||
    die "swtpm_setup failed: see $1/swtpm_setup.log"
}
for node in cp worker; do
  mkdir -p "$MINI/$node"
  manufacture "$MINI/$node"
done
cp "$MINI/ca/issuercert.pem" "$MINI/ek-ca.pem"
phase_done "EK CA + 2 TPMs" "$t"

# ---- component mirror ------------------------------------------------------
t=$(now)
strip -o "$MINI/keel-standin" "$TARGET_DIR/keel-standin"
"$TARGET_DIR/keel-mini-mirror" --standin "$MINI/keel-standin" --guest-host 10.0.2.2 \
  --components "$MINI/components.json" >"$MINI/mirror.log" 2>&1 &
track $!
for _ in $(seq 100); do grep -q '^mirror:' "$MINI/mirror.log" && break; sleep 0.1; done
grep -q '^mirror:' "$MINI/mirror.log" || die "the mirror did not start: $(cat "$MINI/mirror.log")"
log "$(grep '^mirror:' "$MINI/mirror.log") (guests: 10.0.2.2)"
phase_done "component mirror" "$t"

# ---- secrets, configs, measurements ---------------------------------------
t=$(now)
cp_init=$(free_port) cp_join=$(free_port) worker_init=$(free_port)
(umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$MINI/init-secret")
secret_hash="sha256:$(sha256sum "$MINI/init-secret" | cut -d' ' -f1)"
node_config() { # $1 = name, $2 = role
  python3 - "$1" "$2" "$secret_hash" "$cp_join" "$MINI/ek-ca.pem" <<'EOF'
import json, sys
name, role, secret_hash, join_port, ca = sys.argv[1:]
print(json.dumps({
    "cluster": {
        "init_secret_hash": secret_hash,
        "control_plane_endpoints": [f"10.0.2.2:{join_port}"],
        "init_port": 9000,
        "join_port": 9090,
        "ek_ca_pem": open(ca).read(),
    },
    "node": {"name": name, "role": role, "state_disk": "/dev/vdb"},
}, indent=2))
EOF
}
node_config keel-cp-0 control-plane >"$MINI/cp/node-config.json"
node_config keel-worker-0 worker >"$MINI/worker/node-config.json"
"$TARGET_DIR/keel-measure" --uki "$IMAGE/keel.efi" --node-config "$MINI/cp/node-config.json" \
  --output "$MINI/measurements.pred.json"
# PCRs 4, 9, 11, 12 enforced, PCR 15 (cluster ID) zero for a node to init;
# the verify settings accept a locked node (PCR 15 warn-only).
python3 - "$MINI" <<'EOF'
import json, sys
d = sys.argv[1]
m = json.load(open(f"{d}/measurements.pred.json"))
m["15"] = {"expected": "00" * 32, "warnOnly": False}
json.dump(m, open(f"{d}/measurements.json", "w"), indent=2)
m["15"]["warnOnly"] = True
json.dump(m, open(f"{d}/measurements.verify.json", "w"), indent=2)
EOF
settings() { # $1 = endpoint, $2 = measurements
  printf '{"endpoint": "%s", "kubernetes_version": "v1.31", "measurements": "%s", "ek_ca": "ek-ca.pem", "init_secret_file": "init-secret", "components_file": "components.json"}\n' "$1" "$2"
}
settings "127.0.0.1:$cp_init" measurements.json >"$MINI/keel.json"
settings "127.0.0.1:$cp_init" measurements.verify.json >"$MINI/verify-cp.json"
settings "127.0.0.1:$worker_init" measurements.verify.json >"$MINI/verify-worker.json"
phase_done "configs + measurements" "$t"

# ---- VMs -------------------------------------------------------------------
ACCEL=$(accel)
case $ACCEL in kvm) accel_args=(-accel kvm -cpu host) ;; *) accel_args=(-accel tcg -cpu max) ;; esac
log "accelerator: $ACCEL"

start_vm() { # $1 = node, $2 = host forwards (comma-separated hostfwd=... list), [$3 = disk image]
  local d=$MINI/$1
  [ -f "$d/vars.fd" ] || cp "$OVMF_VARS" "$d/vars.fd"
  [ -f "$d/state.raw" ] || truncate -s 256M "$d/state.raw"
  rm -f "$d/swtpm.sock"
  swtpm socket --tpm2 --terminate --tpmstate "dir=$d/tpm" \
    --ctrl "type=unixio,path=$d/swtpm.sock" --log "file=$d/swtpm.log" &
  track $!
  for _ in $(seq 100); do [ -S "$d/swtpm.sock" ] && break; sleep 0.1; done
  [ -S "$d/swtpm.sock" ] || die "swtpm for $1 did not start: $d/swtpm.log"
  : >>"$d/serial.log"
  qemu-system-x86_64 -machine q35 "${accel_args[@]}" -smp 2 -m 2048 \
    -nodefaults -display none -no-reboot \
    -serial "file:$d/serial.log" \
    -drive "if=pflash,format=raw,readonly=on,file=$OVMF_CODE" \
    -drive "if=pflash,format=raw,file=$d/vars.fd" \
    -chardev "socket,id=chrtpm,path=$d/swtpm.sock" \
    -tpmdev emulator,id=tpm0,chardev=chrtpm -device tpm-tis,tpmdev=tpm0 \
    -drive "if=none,id=os,format=raw,snapshot=on,file=${3:-$IMAGE_DISK}" \
    -device virtio-blk-pci,drive=os,bootindex=1 \
    -drive "if=none,id=state,format=raw,file=$d/state.raw" \
    -device virtio-blk-pci,drive=state \
    -netdev "user,id=n0,net=10.0.2.0/24,$2" -device virtio-net-pci,netdev=n0,romfile= \
    -fw_cfg "name=opt/keel/node-config,file=$d/node-config.json" \
    >"$d/qemu.log" 2>&1 &
  track $!
  echo $! >"$d/qemu.pid"
}

# Waits until the node's serial log has a line matching $2 (ERE); fails on
# QEMU's exit or after the patience.
wait_line() { # $1 = node, $2 = pattern, $3 = patience (s)
  local d=$MINI/$1 deadline=$((SECONDS + ${3:-$patience}))
  while ! grep -qE "$2" "$d/serial.log" 2>/dev/null; do
    kill -0 "$(cat "$d/qemu.pid")" 2>/dev/null || { log "$1: QEMU exited; tail of $d/serial.log:"; tail -20 "$d/serial.log" >&2; return 1; }
    [ $SECONDS -lt "$deadline" ] || { log "$1: no /$2/ within ${3:-$patience} s; tail of $d/serial.log:"; tail -20 "$d/serial.log" >&2; return 1; }
    sleep 1
  done
}

t=$(now)
start_vm cp "hostfwd=tcp:127.0.0.1:$cp_init-:$GUEST_INIT_PORT,hostfwd=tcp:127.0.0.1:$cp_join-:$GUEST_JOIN_PORT"
start_vm worker "hostfwd=tcp:127.0.0.1:$worker_init-:$GUEST_INIT_PORT"
log "booting keel-cp-0 and keel-worker-0 (serial logs: $MINI/{cp,worker}/serial.log)"
wait_line cp 'keel-agent: ready' || die "the control plane did not come up"
phase_done "boot control plane" "$t"
wait_line cp 'init server listening' 120 || die "the control plane's init server did not start"

# ---- init ------------------------------------------------------------------
t=$(now)
log "keel init against 127.0.0.1:$cp_init (aTLS)"
"$TARGET_DIR/keel" init --skip-helm-wait --settings "$MINI/keel.json" \
  --workspace "$MINI/workspace" 2>&1 | tee "$MINI/init.log" >&2 ||
  die "keel init failed: $MINI/init.log, $MINI/cp/serial.log"
grep -q '^cluster created' "$MINI/init.log" || die "keel init failed: $MINI/init.log"
cluster_id=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["cluster_id"])' "$MINI/workspace/keel-id.json")
phase_done "keel init" "$t"

# ---- join ------------------------------------------------------------------
t=$(now)
wait_line worker 'keel-agent: ready' || die "the worker did not come up"
log "waiting for the worker to join"
wait_line worker 'this node joined the cluster|joined the cluster' "$patience" ||
  die "the worker did not join: $MINI/worker/serial.log, $MINI/cp/serial.log"
phase_done "worker join" "$t"

# ---- summary ---------------------------------------------------------------
t=$(now)
summary() { # $1 = node, $2 = role, $3 = verify settings
  local d=$MINI/$1 out
  out=$("$TARGET_DIR/keel" verify --settings "$3" 2>&1) || { log "$1: keel verify failed: $out"; out=""; }
  echo "$out" >"$d/verify.txt"
  local pcr15 events
  pcr15=$(awk '$1 == "pcr" && $2 == "15" { print $3 }' <<<"$out")
  events=$(grep -oE 'event log \([0-9]+ events' <<<"$out" | grep -oE '[0-9]+' || true)
  printf '  %-14s role %-13s PCR 15 %s\n' "$1" "$2" "${pcr15:-?}"
  printf '  %-14s attestation %s, event log %s\n' "" \
    "$([ -n "$out" ] && echo verified || echo 'NOT verified')" \
    "$([ -n "$events" ] && echo "replays ($events events)" || echo 'not checked')"
  # Components: measured events in the attested event log. State disk: the
  # agent's line, and the host's look at the disk image's header.
  local components disk
  components=$(grep -cE '^ +#[0-9]+ pcr 13 component:' <<<"$out" || true)
  disk=$(grep -oE 'state disk (set up|opened) \(LUKS2\)[^"]*mount_point=[^ ]+|state disk (set up|opened) \(LUKS2\), mounted at [^ ]+' \
    "$d/serial.log" | tail -1 | sed 's/ *mount_point=/, mounted at /')
  if cryptsetup isLuks --type luks2 "$d/state.raw" 2>/dev/null; then
    disk="LUKS2 header on $(basename "$d")/state.raw${disk:+; agent: $disk}"
  else
    disk="NOT LUKS2"
  fi
  printf '  %-14s state disk: %s\n' "" "$disk"
  printf '  %-14s components: %s measured into PCR 13 (attested event log)\n' "" "$components"
}
{
  echo
  echo "keel local cluster ($ACCEL)"
  echo "  cluster ID     $cluster_id"
  summary cp control-plane "$MINI/verify-cp.json"
  summary worker worker "$MINI/verify-worker.json"
  echo "  admin kubeconfig $MINI/workspace/keel-admin.conf"
  echo "phases:"
  phase_done summary "$t"
  printf '  %s\n' "${phases[@]}"
  echo "  total                        $(since "$t_total") s"
} | tee "$MINI/summary.txt"

[ "$e2e" = 1 ] || exit 0
# shellcheck source=scripts/mini-e2e.sh
source "$ROOT/scripts/mini-e2e.sh"
