SHELL := /bin/bash

# ferrovm: build, demo, tests, benchmarks.
#   make run    builds everything and boots the bundled demo guest
#   make test   runs the whole suite (format, lint, unit and guest-booting tests)
#   make bench  benchmarks against QEMU and a raw KVM_RUN loop -> docs/benchmarks.md
#   make check-freebsd  type-checks and lints the workspace for FreeBSD (needs the Rust target)
#   make fuzz   coverage-guided fuzzing of the untrusted-input parsers (AFL++; docs/testing.md)
#   make linux  the Linux test guest: kernel and initramfs in target/linux (guests/linux/README.md)
#   make debian-image  a Debian bookworm root disk for that kernel, target/linux/debian.img (root)
#   make test-linux  boots it under ferrovm: SMP, both irqchips, drivers, devices, power, login (minutes)

CARGO ?= cargo
GUESTS_DIR := target/guests
FERROVM := target/release/ferrovm
FREEBSD_TARGET := x86_64-unknown-freebsd

.PHONY: all deps build guests run test fcsdk check-kvm fmt-check clippy check-freebsd \
	check-freebsd-if-installed unit-tests clean bench fuzz fuzz-seeds soak props

all: build

# Everything the build needs that a fresh machine of this kind may lack.
deps:
	@./scripts/install-deps.sh

guests: deps
	$(MAKE) -C guests O=$(CURDIR)/$(GUESTS_DIR)

build: deps guests
	$(CARGO) build --release --workspace

run: build
	$(FERROVM) run --kernel $(GUESTS_DIR)/hello.elf --cmdline "console=ttyS0 greeting=hello" --memory 256M

check-kvm:
	@if [ ! -c /dev/kvm ]; then \
		echo "==================================================================" >&2; \
		echo "ERROR: /dev/kvm is missing. The guest-booting tests need KVM;"       >&2; \
		echo "they are run, not skipped, and they will fail on this machine."     >&2; \
		echo "==================================================================" >&2; \
	fi

fmt-check: deps
	$(CARGO) fmt --all -- --check

clippy: deps
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# Cross-check for FreeBSD hosts: library and program targets only (the tests boot guests
# under KVM). Nothing runs; a FreeBSD kernel is needed for that.
check-freebsd: deps
	$(CARGO) check --workspace --target $(FREEBSD_TARGET)
	$(CARGO) clippy --workspace --target $(FREEBSD_TARGET) -- -D warnings

# `make test` installs the target's standard library when rustup can reach its server, and
# cross-checks wherever it is installed; without it the check is skipped with one line.
check-freebsd-if-installed:
	@if ! rustup target list --installed 2>/dev/null | grep -qx '$(FREEBSD_TARGET)'; then \
		timeout 300 rustup target add $(FREEBSD_TARGET) >/dev/null 2>&1 || true; \
	fi; \
	if rustup target list --installed 2>/dev/null | grep -qx '$(FREEBSD_TARGET)'; then \
		$(MAKE) --no-print-directory check-freebsd; \
	else \
		echo "FreeBSD cross-check skipped: Rust target $(FREEBSD_TARGET) is not installed and could not be downloaded (rustup target add $(FREEBSD_TARGET))"; \
	fi

# The property tests draw their cases from a fixed seed here, so a red run is repeatable;
# `make props` draws fresh cases every time.
PROPTEST_SEED ?= 1

# The firecracker-go-sdk test program (tests/fcsdk.rs runs it): Go modules from the Go proxy.
FCSDK = target/fcsdk
GO ?= $(shell command -v go || echo /usr/local/go/bin/go)
fcsdk: deps
	cd tests/go/fcsdk && GOFLAGS=-mod=mod $(GO) build -o $(CURDIR)/$(FCSDK) .

test: deps guests fcsdk check-kvm fmt-check clippy check-freebsd-if-installed
	$(CARGO) build --workspace
	@set -o pipefail; \
	FERROVM_FCSDK=$(CURDIR)/$(FCSDK) PROPTEST_RNG_SEED=$(PROPTEST_SEED) FERROVM_GUESTS=$(CURDIR)/$(GUESTS_DIR) $(CARGO) test --workspace --all-targets 2>&1 \
		| tee target/test.log; status=$$?; \
	awk '/^test result:/ { p += $$4; f += $$6 } END { printf "tests: %d passed, %d failed\n", p, f }' target/test.log; \
	exit $$status

# Benchmarks (root and /dev/kvm; about 20 minutes): docs/benchmarks.md and docs/bench-*.png,
# every sample in target/bench/results.json. BENCH_ARGS=--quick for a smoke test.
bench: build
	./bench/run.sh $(BENCH_ARGS)

clean:
	$(CARGO) clean
	$(MAKE) -C guests O=$(CURDIR)/$(GUESTS_DIR) clean

# The migration soak (not part of `make test`, a few minutes): a dirtying guest migrated back
# and forth 100 times over loopback with a snapshot and restore every 10 hops; the guest's
# invariant, the VMM's memory and its file descriptors checked after each (docs/testing.md).
soak: build
	python3 scripts/soak.py $(SOAK_ARGS)

# The Linux test guest (guests/linux/README.md): a kernel from Debian's linux-source-6.12
# (cached outside the work tree: the first build takes minutes, later ones copy it) and a
# busybox initramfs, in target/linux.
LINUX_DIR := target/linux
.PHONY: linux linux-deps test-linux debian-image
linux-deps:
	@./scripts/install-linux-deps.sh

linux: linux-deps
	./scripts/linux-kernel.sh $(LINUX_DIR)
	./scripts/linux-initramfs.sh $(LINUX_DIR)

# Debian bookworm on a 1 GiB ext4 disk (guests/linux/debian/README.md): debootstrap from
# Debian's mirror, cached outside the work tree like the kernel. Needs root.
debian-image: linux
	./scripts/debian-image.sh $(LINUX_DIR)

# The Linux boot tests (tests/linux.rs; docs/linux-guest.md): every boot takes minutes on a
# host that emulates guest ring 0, so they are a target of their own. One boot at a time:
# an SMP guest whose vCPUs outnumber the host's cores spends its time spinning on CPUs that
# are not running. The release build of ferrovm runs them (LINUX_TEST_THREADS changes it).
LINUX_TEST_THREADS ?= 1
test-linux: deps guests linux debian-image fcsdk check-kvm
	$(CARGO) build --release --workspace
	@set -o pipefail; \
	FERROVM_LINUX=$(CURDIR)/$(LINUX_DIR) FERROVM_GUESTS=$(CURDIR)/$(GUESTS_DIR) FERROVM_FCSDK=$(CURDIR)/$(FCSDK) \
		$(CARGO) test --release -p ferrovm --test linux --test linux_devices --test linux_debian --test fcsdk -- --ignored --test-threads=$(LINUX_TEST_THREADS) 2>&1 \
		| tee target/test-linux.log

# Coverage-guided fuzzing (not part of `make test`): each target of fuzz/ for FUZZ_SECONDS
# (default 60) with AFL++, installing cargo-afl when missing. FUZZ_TARGETS picks targets,
# FUZZ_UPDATE_CORPUS=1 merges what was found into fuzz/corpus (minimised). docs/testing.md.
fuzz:
	FUZZ_SECONDS=$(or $(FUZZ_SECONDS),60) ./scripts/fuzz.sh

# The property tests with fresh random cases (not part of `make test`, which fixes the seed),
# PROPS_RUNS times over (default 5).
props:
	for run in $$(seq $(or $(PROPS_RUNS),5)); do \
		PROPTEST_RNG_SEED=$$(od -An -N8 -tu8 /dev/urandom | tr -d ' ') ; echo "seed $$PROPTEST_RNG_SEED"; \
		PROPTEST_RNG_SEED=$$PROPTEST_RNG_SEED $(CARGO) test -p boot -p migration -p devices -p vmm -p virtio props || exit 1; \
	done

# Rewrites the seed inputs of fuzz/corpus from the crates' own test builders.
fuzz-seeds:
	FERROVM_FUZZ_CORPUS=$(CURDIR)/fuzz/corpus $(CARGO) test -p boot --lib -- --ignored write_fuzz_seeds
	FERROVM_FUZZ_CORPUS=$(CURDIR)/fuzz/corpus $(CARGO) test -p migration --test props -- --ignored write_fuzz_seeds
	FERROVM_FUZZ_CORPUS=$(CURDIR)/fuzz/corpus $(CARGO) test -p devices --test state_props -- --ignored write_fuzz_seeds
	FERROVM_FUZZ_CORPUS=$(CURDIR)/fuzz/corpus $(CARGO) test -p vmm --test api_props -- --ignored write_fuzz_seeds
	FERROVM_FUZZ_CORPUS=$(CURDIR)/fuzz/corpus $(CARGO) test -p virtio --test chain_props -- --ignored write_fuzz_seeds
	FERROVM_FUZZ_CORPUS=$(CURDIR)/fuzz/corpus $(CARGO) test -p virtio --test pci_props -- --ignored write_fuzz_seeds
