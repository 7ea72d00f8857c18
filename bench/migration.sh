#!/usr/bin/env bash
# Live-migration figures: idle guests of several sizes and dirtying guests, on loopback and
# over a veth pair between two network namespaces shaped to 1 Gbit/s with tc.
# Writes a markdown table to stdout. Needs root (namespaces, tc) and /dev/kvm.
#   bench/migration.sh [quick]     (quick: 1 and 2 GiB idle, 256 MiB dirtying)
# For bench/bench.py (docs/benchmarks.md), one case at a time:
#   bench/migration.sh netns-up | netns-down      create / delete the 1 Gbit/s namespaces
#   bench/migration.sh case LINK GUEST CMDLINE MEMORY [migrate options...]
#       LINK = loopback | 1gbit; prints the `ctl --json migrate` reply as one line (the
#       namespaces are created and deleted around the case unless netns-up made them)
set -euo pipefail
cd "$(dirname "$0")/.."
FERROVM=${FERROVM:-target/release/ferrovm}
GUESTS=${GUESTS:-target/guests}
WORK=$(mktemp -d)
NS_A=fvbencha NS_B=fvbenchb
OWN_NETNS=0
cleanup() {
    pkill -f "$WORK" 2>/dev/null || true
    if [ $OWN_NETNS = 1 ]; then
        ip netns del $NS_A 2>/dev/null || true
        ip netns del $NS_B 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

setup_netns() {
    OWN_NETNS=1
    ip netns del $NS_A 2>/dev/null || true
    ip netns del $NS_B 2>/dev/null || true
    ip netns add $NS_A
    ip netns add $NS_B
    ip link add fvbx netns $NS_A type veth peer name fvby netns $NS_B
    ip -n $NS_A addr add 10.214.0.1/30 dev fvbx
    ip -n $NS_B addr add 10.214.0.2/30 dev fvby
    for ns in $NS_A $NS_B; do ip -n $ns link set lo up; done
    ip -n $NS_A link set fvbx up
    ip -n $NS_B link set fvby up
    # 1 Gbit/s each way.
    ip netns exec $NS_A tc qdisc add dev fvbx root tbf rate 1gbit burst 1mb latency 50ms
    ip netns exec $NS_B tc qdisc add dev fvby root tbf rate 1gbit burst 1mb latency 50ms
}

# migrate_case LINK GUEST CMDLINE MEMORY [migrate options...]: prints the JSON reply.
migrate_case() {
    local link=$1 guest=$2 cmdline=$3 memory=$4
    shift 4
    local src_ns="" dst_ns="" addr=127.0.0.1
    if [ "$link" = "1gbit" ]; then
        src_ns="ip netns exec $NS_A"
        dst_ns="ip netns exec $NS_B"
        addr=10.214.0.2
    fi
    local port=$((7600 + RANDOM % 1000))
    $dst_ns "$FERROVM" run --incoming "tcp:$addr:$port" --memory "$memory" --serial "file:$WORK/dst.serial" \
        --api-socket "$WORK/dst.sock" >/dev/null 2>"$WORK/dst.err" &
    local dst=$!
    $src_ns "$FERROVM" run --kernel "$GUESTS/$guest.elf" --cmdline "$cmdline" --memory "$memory" \
        --serial "file:$WORK/src.serial" --api-socket "$WORK/src.sock" >/dev/null 2>"$WORK/src.err" &
    local src=$!
    # Wait until the guest has touched its memory (first progress/tick line).
    for _ in $(seq 1 600); do
        if grep -qE "tick 1 ok|: pass [1-9]" "$WORK/src.serial" 2>/dev/null; then break; fi
        sleep 0.2
    done
    local report
    report=$("$FERROVM" ctl --api-socket "$WORK/src.sock" --json migrate "tcp:$addr:$port" "$@" || true)
    wait $src 2>/dev/null || true
    "$FERROVM" ctl --api-socket "$WORK/dst.sock" shutdown >/dev/null 2>&1 || kill $dst 2>/dev/null || true
    wait $dst 2>/dev/null || true
    rm -f "$WORK"/*.serial "$WORK"/*.sock
    echo "$report"
}

# run_case LINK GUEST CMDLINE MEMORY [migrate options...]: prints a table row.
run_case() {
    local link=$1 guest=$2 cmdline=$3 memory=$4
    local report
    report=$(migrate_case "$@")
    python3 - "$link" "$guest $cmdline" "$memory" "$report" <<'PY'
import json, sys
link, guest, memory, raw = sys.argv[1:5]
try:
    r = json.loads(raw)["report"]
except Exception:
    print(f"| {link} | {guest} | {memory} | failed | | | | |")
    sys.exit(0)
print(f"| {link} | {guest} | {memory} | {r['total_ms']/1000:.2f} s | {r['downtime_ms']:.1f} ms | "
      f"{r['bytes_total']/2**20:.0f} MiB | {len(r['rounds'])} | {r['converged']} (throttle {r['max_throttle_percent']}%) |")
PY
}

case "${1:-}" in
netns-up)
    setup_netns
    OWN_NETNS=0
    exit 0
    ;;
netns-down)
    OWN_NETNS=1
    exit 0
    ;;
case)
    shift
    if [ "$1" = 1gbit ] && ! ip netns list | grep -qw $NS_A; then
        setup_netns
    fi
    migrate_case "$@"
    exit 0
    ;;
esac

echo "| link | guest | memory | total | downtime | sent | rounds | converged |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
setup_netns
if [ "${1:-}" = quick ]; then
    sizes="1 2"
    dirty="256"
else
    sizes="1 2 4 8"
    dirty="256 1024"
fi
for link in loopback 1gbit; do
    for gib in $sizes; do
        # The guest touches most of its RAM below the 3 GiB MMIO hole; pages it never
        # touched are not sent.
        touch=$((gib * 1024 - 128)); [ $touch -gt 2900 ] && touch=2900
        run_case $link migrate-idle "mib=$touch" "${gib}G"
    done
    for mib in $dirty; do
        run_case $link migrate-dirty "mib=$mib" 2G --auto-converge --max-time-s 120
    done
done
