# keel: build, test and run a measured-boot Kubernetes node image.
# `make help` lists the targets.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
TARGET := x86_64-unknown-linux-musl
AGENT := target/$(TARGET)/release/keel-agent
INITRD := target/$(TARGET)/release/keel-initrd
# Cargo finds the static TPM libraries through .cargo/config.toml.
CARGO ?= cargo

.PHONY: help deps tss agent binaries test lint fmt image image-prepare image-repro measurements vm-check demo e2e

help: ## List targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{ printf "  %-14s %s\n", $$1, $$2 }'

deps: ## Install every host package the build, tests and image need (idempotent)
	@scripts/deps.sh

tss: deps ## Build the static Mbed TLS + tpm2-tss for musl (cached in target/musl-sysroot); keep build paths out of binaries
	@scripts/build-tss.sh
	@scripts/build-paths.sh

agent: tss ## Build the static agent and the initrd's init; report paths and sizes, fail above 8 MiB
	$(CARGO) build --release --locked -p keel-agent --bin keel-agent -p keel-initrd --bin keel-initrd
	@scripts/check-static.sh $(AGENT)
	@scripts/check-static.sh $(INITRD)

test: tss ## Run every test that does not boot a VM (TPM tests use swtpm)
	$(CARGO) test --locked --workspace

lint: tss ## rustfmt check and clippy with warnings as errors
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --locked --workspace --all-targets -- -D warnings

fmt: ## Format the code
	$(CARGO) fmt --all

image: agent ## Build the reproducible mkosi image (UKI, dm-verity erofs root) and print its artifacts
	@scripts/image-build.sh

image-prepare: deps ## What the image needs besides the agent: package sources, tools tree, stub, its packages installed (cached)
	@scripts/image-build.sh --prepare

# Everything the local cluster runs from a release build: the agent and the
# initrd's init (for the image) and the host tools (keel, keel-mini, the
# stand-ins). One cargo invocation runs their long link steps side by side;
# and because the workspace declares the features every crate is built with,
# `make agent` resolves the same units afterwards and has nothing to do.
RELEASE_BINS := -p keel-agent --bin keel-agent -p keel-initrd --bin keel-initrd \
  -p keel-cli --bin keel -p keel-e2e --bin keel-mini \
  -p keel-testkit --bin keel-standin --bin keel-mini-mirror

binaries: tss ## Release builds of the agent, the initrd's init, keel, keel-mini and the local cluster's stand-ins
	@start=$$SECONDS; $(CARGO) build --release --locked $(RELEASE_BINS); \
	  echo "binaries: built in $$((SECONDS - start)) s"

image-repro: agent ## Build the image three times (no cache, filling the package cache, from it) and compare every artifact
	@scripts/image-repro.sh

measurements: ## Predict PCRs 4, 9, 11 and 12 of the built image for NODE_CONFIG into build/image/measurements.json
	@test -n "$(NODE_CONFIG)" || { echo "make measurements: set NODE_CONFIG=<node config file> (PCR 12 is measured from it)" >&2; exit 2; }
	$(CARGO) run --release --locked -p keel-image --bin keel-measure -- \
	  --uki build/image/keel.efi --node-config "$(NODE_CONFIG)" --output build/image/measurements.json

vm-check: image ## Boot the image 3 times under QEMU + swtpm; compare PCRs, time to ready
	@scripts/vm-boot.sh -n 3

# The first build overlaps what does not depend on each other: the image's
# tools tree and package sources are fetched, and its packages installed
# into mkosi's cache, while the TPM libraries and then every binary build.
demo: deps ## Local cluster on QEMU + swtpm: build, boot two control planes and a worker, init, joins, summary
	@$(MAKE) --no-print-directory -j2 image-prepare binaries
	target/$(TARGET)/release/keel-mini up

e2e: image ## The local cluster, then the end-to-end scenarios (refusals, second init, rejoin, disk)
	KEEL_IMAGE_DIR=build/image $(CARGO) test --locked -p keel-e2e --test e2e -- --nocapture
