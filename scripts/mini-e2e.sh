# End-to-end scenarios on the running local cluster. Sourced by
# scripts/mini-up.sh --e2e after the happy path (control plane initialised,
# worker joined); uses its variables and functions (start_vm, wait_line,
# node_config, settings, MINI, TARGET_DIR). Each scenario prints PASS, FAIL
# or SKIP with its reason; the exit status is 1 if any failed.

results=()
failed=0
pass() { results+=("PASS  $1"); log "PASS $1"; }
fail() { results+=("FAIL  $1: $2"); log "FAIL $1: $2"; failed=1; }
skip() { results+=("SKIP  $1: $2"); log "SKIP $1: $2"; }

# Lines the control plane logged since a mark (a line count).
cp_since() { tail -n +"$(($1 + 1))" "$MINI/cp/serial.log"; }
cp_mark() { wc -l <"$MINI/cp/serial.log"; }

# (1) happy path: mini-up.sh got here only if init and join succeeded.
pass "happy path: init over aTLS, worker joined"

# (4) a second init is refused by the node itself (the CLI is told to
# accept any PCR 15, so the request reaches the node).
t=$(now)
settings "127.0.0.1:$cp_init" measurements.verify.json >"$MINI/keel-again.json"
if out=$("$TARGET_DIR/keel" init --skip-helm-wait --settings "$MINI/keel-again.json" \
  --workspace "$MINI/workspace-again" 2>&1); then
  fail "second init refused" "the second init succeeded: $out"
elif grep -qE 'FailedPrecondition|already part of a cluster' <<<"$out"; then
  pass "second init refused ($(grep -oE 'FailedPrecondition[^.]*' <<<"$out" | head -1)) [$(since "$t") s]"
else
  fail "second init refused" "refused for another reason: $out"
fi

# (2) a node with another cluster config (its PCR 12 differs) and (3) a node
# whose image differs in one byte of the UKI command line boot in parallel;
# the join service must refuse both and name the PCR.
t=$(now)
mark=$(cp_mark)
mkdir -p "$MINI/other-config" "$MINI/other-image"
python3 - "$MINI/worker/node-config.json" "$MINI/other-config/node-config.json" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
c["cluster"]["init_port"] = 9001   # same cluster otherwise: only PCR 12 differs
c["node"]["name"] = "keel-other-config"
json.dump(c, open(sys.argv[2], "w"), indent=2)
EOF
sed 's/keel-worker-0/keel-other-image/' "$MINI/worker/node-config.json" >"$MINI/other-image/node-config.json"
cp "$IMAGE_DISK" "$MINI/other-image/keel.raw"
changed=$(python3 - "$MINI/other-image/keel.raw" <<'EOF'
import mmap, sys
# One byte of the UKI's .cmdline: "quiet" becomes "quieT" (an unknown
# parameter the kernel passes on; the boot itself is unaffected).
with open(sys.argv[1], "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
    at = m.find(b" console=ttyS0 quiet ")
    if at < 0:
        print("none")
    else:
        m[at + 19] = ord("T")
        print(at + 19)
EOF
)
for n in other-config other-image; do
  manufacture "$MINI/$n"
done
if [ "$changed" = none ]; then
  skip "changed image refused" "the UKI command line was not found in the disk image"
else
  start_vm other-image "restrict=off" "$MINI/other-image/keel.raw"
fi
start_vm other-config "restrict=off"
refused() { # $1 = scenario, $2 = node, $3 = PCR pattern
  local deadline=$((SECONDS + patience)) lines
  while [ $SECONDS -lt $deadline ]; do
    lines=$(cp_since "$mark" | grep -iE 'join ticket refused|refused' | grep -iE "$3" || true)
    if [ -n "$lines" ]; then
      if grep -qE 'joined the cluster' "$MINI/$2/serial.log"; then
        fail "$1" "the node joined"
      else
        pass "$1 [$(since "$t") s]: the join service logged \"aTLS handshake refused ... $(head -1 <<<"$lines" | grep -oE 'PCR [0-9]+: expected [0-9a-f]{12}' | head -1)...\""
      fi
      return
    fi
    if grep -qE 'joined the cluster' "$MINI/$2/serial.log" 2>/dev/null; then
      fail "$1" "the node joined"
      return
    fi
    sleep 2
  done
  fail "$1" "no refusal naming the PCR in the control plane's log within $patience s (see $MINI/cp/serial.log, $MINI/$2/serial.log)"
}
refused "other config refused (PCR 12)" other-config 'PCR ?12|pcr ?12'
[ "$changed" = none ] || refused "changed image refused (PCR 4/9/11)" other-image 'PCR ?(4|9|11)|pcr ?(4|9|11)'
for n in other-config other-image; do
  [ -f "$MINI/$n/qemu.pid" ] && kill "$(cat "$MINI/$n/qemu.pid")" 2>/dev/null || true
done

# (5) the worker reboots (same TPM, firmware variables and state disk) and
# rejoins through IssueRejoinTicket, unlocking its state disk.
t=$(now)
kill "$(cat "$MINI/worker/qemu.pid")" 2>/dev/null || true
sleep 2
mv "$MINI/worker/serial.log" "$MINI/worker/serial.boot1.log"
start_vm worker "hostfwd=tcp:127.0.0.1:$worker_init-:$GUEST_INIT_PORT"
if wait_line worker 'rejoined the cluster' "$patience"; then
  if ! grep -qE "rejoined the cluster cluster_id=$cluster_id" "$MINI/worker/serial.log"; then
    fail "worker rejoin" "rejoined another cluster than $cluster_id"
  elif grep -qE 'state disk opened \(LUKS2\) mount_point=/run/state' "$MINI/worker/serial.log"; then
    pass "worker rebooted and rejoined cluster ${cluster_id:0:12}..., state disk opened and mounted [$(since "$t") s]"
  else
    fail "worker rejoin" "rejoined, but no 'state disk opened' line"
  fi
else
  fail "worker rejoin" "no 'rejoined the cluster' line (see $MINI/worker/serial.log)"
fi

# (6) each state disk is LUKS2 and opens with the key the cluster derives
# for it (HKDF-SHA256 of the master secret, info "disk:<uuid>"), and neither
# that key, the init secret nor the master secret appears in any log.
t=$(now)
logs=("$MINI"/*/serial*.log "$MINI/init.log" "$MINI"/*/qemu.log)
secrets_file=$MINI/e2e-secrets
(
  umask 077
  for n in cp worker; do
    uuid=$(cryptsetup luksUUID "$MINI/$n/state.raw" 2>/dev/null) || continue
    python3 - "$MINI/workspace/keel-master-secret.json" "$uuid" "$MINI/$n/disk-key" <<'PY'
import base64, hashlib, hmac, json, sys
m = json.load(open(sys.argv[1]))
prk = hmac.new(bytes.fromhex(m["salt"]), bytes.fromhex(m["key"]), hashlib.sha256).digest()
key = hmac.new(prk, ("disk:" + sys.argv[2].lower()).encode() + b"\x01", hashlib.sha256).digest()
open(sys.argv[3], "wb").write(key)
print(key.hex(), base64.b64encode(key).decode())
PY
  done
  cat "$MINI/init-secret"; echo
  python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["key"])' "$MINI/workspace/keel-master-secret.json"
) >"$secrets_file"
disk_ok=1
for n in cp worker; do
  if ! cryptsetup isLuks --type luks2 "$MINI/$n/state.raw" 2>/dev/null; then
    fail "state disk LUKS2" "$MINI/$n/state.raw is not a LUKS2 volume"; disk_ok=0
  elif ! cryptsetup open --test-passphrase --key-file "$MINI/$n/disk-key" "$MINI/$n/state.raw" 2>/dev/null; then
    fail "state disk key" "the key derived for $n's disk does not open it"; disk_ok=0
  fi
  rm -f "$MINI/$n/disk-key"
done
leaked=$(tr ' ' '\n' <"$secrets_file" | grep -vE '^-?$' | grep -F -f - "${logs[@]}" | head -3 || true)
rm -f "$secrets_file"
if [ -n "$leaked" ]; then
  fail "no secret in the logs" "a disk key, the init secret or the master secret appears in a log"
elif [ "$disk_ok" = 1 ]; then
  pass "both state disks are LUKS2 and open with the cluster-derived key; no disk key, init secret or master secret in any log [$(since "$t") s]"
fi

echo
echo "end-to-end scenarios:"
printf '  %s\n' "${results[@]}"
[ "$failed" = 0 ]
