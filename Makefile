# idemgate: the front door.
#   make demo    watch the filter at work in a real Envoy
#   make test    everything CI runs: lint, wasm build, bootstrap validation, tests
# Point ENVOY_BIN at any Envoy >= 1.35 to use it instead of the pinned wheel.

ENVOY ?= $(or $(ENVOY_BIN),$(CURDIR)/.tools/venv/bin/envoy)
WASM  := target/idemgate.wasm

.PHONY: setup wasm build lint test demo bench clean
.NOTPARALLEL:

setup:
	@scripts/setup.sh

wasm: setup
	@scripts/wasm.sh

build: setup
	cargo build --workspace
	@scripts/wasm.sh

lint: setup
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings
	scripts/wasm.sh clippy

# Bootstraps named _*.yaml are fragments, not complete configs.
test: setup lint wasm
	cargo build -p idemgate-store
	@for f in envoy/*.yaml; do \
	    case $$f in envoy/_*|'envoy/*.yaml') continue;; esac; \
	    $(ENVOY) --mode validate --log-level warn -c $$f || exit 1; \
	done
	IDEMGATE_WASM=$(CURDIR)/$(WASM) \
	IDEMGATE_STORE_BIN=$(CURDIR)/target/debug/idempotency-store \
	ENVOY_BIN=$(ENVOY) \
	    cargo test --workspace
	scripts/demo-smoke.sh

demo: wasm
	@if [ -x scripts/demo.sh ]; then \
	    cargo build -p idemgate-store && scripts/demo.sh; \
	else echo "make demo: not yet"; fi

# Side-by-side benchmark (scripts/bench.sh): Envoy with and without the filter,
# the store on SQLite and PostgreSQL, the replay path, and express-idempotency as
# the peer. Writes bench/results/ and the README's Performance section.
bench:
	@scripts/setup.sh bench
	@scripts/wasm.sh
	cargo build --release -p idemgate-store
	@scripts/bench.sh

clean:
	cargo clean
	rm -rf .demo
