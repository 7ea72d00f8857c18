#!/usr/bin/env bash
# Coverage-guided fuzzing of the untrusted-input parsers with AFL++ (through cargo-afl, on
# stable Rust). Builds the targets of fuzz/, runs each for FUZZ_SECONDS (default 60) from its
# corpus in fuzz/corpus/<target>/, and reports executions per second, coverage, crashes and
# hangs. Exit status 1 when a target crashed or hung; the inputs are copied to
# fuzz/crashes/<target>/ (replayed by `cd fuzz && cargo test` as regression cases).
#
#   FUZZ_SECONDS=N        seconds per target (default 60)
#   FUZZ_TARGETS="a b"    targets to run (default: all)
#   FUZZ_UPDATE_CORPUS=1  minimise corpus + new queue entries (afl-cmin) back into fuzz/corpus
#
# Installs what is missing: a C toolchain (Debian build-essential) and cargo-afl, which builds
# its own AFL++ on installation.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
ALL_TARGETS="boot_loader migration_stream snapshot_file device_state api_request virtio_blk_chains virtio_pci_access qcow2_image"
FUZZ_TARGETS=${FUZZ_TARGETS:-$ALL_TARGETS}
CARGO_AFL_VERSION=0.18.2   # must match the afl crate in fuzz/Cargo.toml
OUT=$ROOT/fuzz/target/afl

ensure_tools() {
    if ! command -v cc >/dev/null || ! command -v make >/dev/null; then
        echo "fuzz: installing a C toolchain (build-essential) for AFL++"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq build-essential
    fi
    if ! cargo afl --version 2>/dev/null | grep -q "$CARGO_AFL_VERSION"; then
        echo "fuzz: installing cargo-afl $CARGO_AFL_VERSION (builds AFL++; a few minutes)"
        cargo install cargo-afl --version "$CARGO_AFL_VERSION" --locked
    fi
    # cargo-afl builds AFL++ on installation; this builds it if that was skipped (and only
    # says "already built" otherwise).
    cargo afl config --build >/dev/null 2>&1 || true
    # afl-cmin runs the first afl-showmap on PATH: make it cargo-afl's own (an older AFL++
    # from a distribution package may be on PATH and lacks options afl-cmin passes).
    local version hash
    version=$(rustc -V | awk '{ print $2 }')
    hash=$(rustc -vV | awk '/^commit-hash/ { print substr($2, 1, 7) }')
    AFL_PATH=${XDG_DATA_HOME:-$HOME/.local/share}/afl.rs/rustc-$version-$hash/afl.rs-$CARGO_AFL_VERSION/afl/bin
    if [ ! -x "$AFL_PATH/afl-showmap" ]; then
        echo "fuzz: cargo-afl's AFL++ is not at $AFL_PATH" >&2
        exit 2
    fi
    export AFL_PATH PATH=$AFL_PATH:$PATH
}

# One line per target from AFL++'s fuzzer_stats.
report() {
    local target=$1 stats=$OUT/$1/default/fuzzer_stats
    if [ ! -f "$stats" ]; then
        echo "fuzz: $target: no statistics (AFL++ did not start; see $OUT/$target.log)"
        return 1
    fi
    awk -F' *: *' -v t="$target" '
        { v[$1] = $2 }
        END {
            printf "fuzz: %-16s %9s execs %8.0f execs/s  corpus %5s  coverage %7s  crashes %s  hangs %s\n",
                t, v["execs_done"], v["execs_per_sec"], v["corpus_count"], v["bitmap_cvg"],
                v["saved_crashes"], v["saved_hangs"]
        }' "$stats"
}

# Copies crashing and hanging inputs into fuzz/crashes/<target>/; true when there were any.
keep_failures() {
    local target=$1 found=1
    for kind in crashes hangs; do
        for f in "$OUT/$target/default/$kind"/id:*; do
            [ -e "$f" ] || continue
            mkdir -p "$ROOT/fuzz/crashes/$target"
            cp "$f" "$ROOT/fuzz/crashes/$target/$(basename "$f" | tr ':,' '__')"
            found=0
        done
    done
    return $found
}

# Replaces fuzz/corpus/<target> by the minimised union of it and the new queue, unless
# minimising fails (the corpus is then left as it was).
update_corpus() {
    local target=$1 merged
    merged=$(mktemp -d)
    cp "$ROOT/fuzz/corpus/$target"/* "$merged"/
    cp "$OUT/$target/default/queue"/id:* "$merged"/ 2>/dev/null || true
    rm -rf "$OUT/$target.cmin"
    # The awk afl-cmin (the Python one finds no coverage in persistent-mode targets here),
    # by edges (-e), not hit counts: a smaller corpus.
    if ! "$AFL_PATH/afl-cmin.awk" -e -i "$merged" -o "$OUT/$target.cmin" -t 5000 \
        -- "$ROOT/fuzz/target/release/$target" >"$OUT/$target.cmin.log" 2>&1 ||
        [ -z "$(ls -A "$OUT/$target.cmin" 2>/dev/null)" ]; then
        rm -rf "$merged"
        echo "fuzz: $target: minimising the corpus failed (see $OUT/$target.cmin.log)"
        return 1
    fi
    rm -rf "$merged" "$ROOT/fuzz/corpus/$target"
    mkdir -p "$ROOT/fuzz/corpus/$target"
    for f in "$OUT/$target.cmin"/*; do
        cp "$f" "$ROOT/fuzz/corpus/$target/$(sha1sum "$f" | cut -c1-16)"
    done
    echo "fuzz: $target: corpus minimised to $(ls "$ROOT/fuzz/corpus/$target" | wc -l) inputs"
}

ensure_tools
(cd fuzz && cargo afl build --release)
mkdir -p "$OUT"
failed=0
for target in $FUZZ_TARGETS; do
    rm -rf "${OUT:?}/$target"
    echo "fuzz: $target for ${FUZZ_SECONDS}s"
    # No UI; this machine's CPU-frequency and core-dump settings are not AFL++'s business.
    AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 \
        AFL_NO_AFFINITY=1 \
        cargo afl fuzz -V "$FUZZ_SECONDS" -t 2000 -i "fuzz/corpus/$target" -o "$OUT/$target" \
        -- "fuzz/target/release/$target" >"$OUT/$target.log" 2>&1 || true
    report "$target" || failed=1
    if keep_failures "$target"; then
        echo "fuzz: $target: failing inputs copied to fuzz/crashes/$target/"
        failed=1
    fi
    if [ "${FUZZ_UPDATE_CORPUS:-0}" = 1 ]; then
        update_corpus "$target" || failed=1
    fi
done
exit $failed
