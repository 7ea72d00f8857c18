#!/usr/bin/env bash
# Re-derives the seccomp allow-lists from what the VMM's threads really call.
#
# Runs integration test suites under `strace -f -ff` with FERROVM_SECCOMP=log (filters in
# place, nothing stopped), sorts every system call of every ferrovm thread into the thread's
# role, and compares with the committed lists in crates/sandbox/profiles/:
#   missing  called but not allowed: add it to the role's profile (or fix the caller);
#   unseen   allowed but not called in this run: keep it only with a reason in a comment
#            (an error path, another host's kernel, a test not run).
# The lists it found are written to OUT/seen/ROLE.txt in the profiles' format.
#
# usage: scripts/seccomp-profile.sh [-o OUT] [TEST...]     (tests: default below)
#   e.g. scripts/seccomp-profile.sh boot api
#        scripts/seccomp-profile.sh -o /tmp/prof migration -- live_migration
# Arguments after `--` go to every test binary (a name filter, --test-threads=1).
# Needs strace, /dev/kvm and the test guests (make guests); FERROVM_GUESTS is honoured.
set -euo pipefail

cd "$(dirname "$0")/.."
out=target/seccomp-profile
tests=()
while [ $# -gt 0 ]; do
    case "$1" in
        -o) out="$2"; shift 2 ;;
        --) shift; break ;;
        *) tests+=("$1"); shift ;;
    esac
done
filter_args=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(boot interrupts pci api virtio migration)
command -v strace >/dev/null || { echo "strace is missing (apt-get install strace)" >&2; exit 2; }
export FERROVM_GUESTS="${FERROVM_GUESTS:-$PWD/target/guests}"

rm -rf "$out"
mkdir -p "$out/traces"
cargo build -q -p ferrovm
for t in "${tests[@]}"; do
    exe=$(cargo test -q -p ferrovm --test "$t" --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") \
            and m["target"]["kind"] == ["test"]:
        print(m["executable"])' | tail -1)
    [ -n "$exe" ] || { echo "no test binary for $t" >&2; exit 2; }
    mkdir -p "$out/traces/$t"
    echo "== $t (traced: $out/traces/$t)" >&2
    # A failing test still leaves its traces; say so, and go on.
    if ! FERROVM_SECCOMP=log strace -f -ff -qq -s 48 -o "$out/traces/$t/t" \
        "$exe" "${filter_args[@]}" >"$out/$t.log" 2>&1; then
        echo "   some $t tests failed under strace (see $out/$t.log)" >&2
    fi
done
python3 scripts/seccomp_profile.py "$out" crates/sandbox/profiles
