# idemgate: the front door.
#   make demo    watch the filter at work in a real Envoy
#   make test    everything CI runs: lint, wasm build, bootstrap validation, tests
#                (with 20 s chaos runs and 25 s per fuzz target)
#   make fuzz    each fuzz target for FUZZ_SECONDS (300)
#   make chaos   the chaos runs for CHAOS_SECONDS (60) each
#   make release target/release-artefacts/: the module and its sha256, the module
#                as OCI image layouts, the release store binary; pins examples/istio
#   make soak    10 minutes at moderate load, then 30 minutes on millions of
#                records with the sweeper at work; memory, WAL, errors (not in CI)
# test, fuzz, chaos and soak write their rows of docs/reliability.md.
# Point ENVOY_BIN at another Envoy (tested: 1.36 to 1.40) to use it instead of the pinned wheel.

# The virtualenv scripts/setup.sh installs Envoy and the e2e tests' SDKs into.
VENV  := $(abspath $(or $(IDEMGATE_VENV),.tools/venv))
ENVOY ?= $(or $(ENVOY_BIN),$(VENV)/bin/envoy)
WASM  := target/idemgate.wasm
E2E_ENV = IDEMGATE_WASM=$(CURDIR)/$(WASM) \
	IDEMGATE_STORE_BIN=$(CURDIR)/target/debug/idempotency-store \
	ENVOY_BIN=$(ENVOY) IDEMGATE_REPORT=$(CURDIR)/docs/reliability.md
FUZZ_SECONDS ?= 300
CHAOS_SECONDS ?= 60
SOAK_SECONDS ?= 600
GROWTH_SECONDS ?= 1800

.PHONY: setup wasm build lint test demo bench clean fuzz chaos soak release
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
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --document-private-items --workspace

# Bootstraps named _*.yaml are fragments, not complete configs.
# The previous release is built before this one's store: both builds put
# their idempotency-store in target/debug/.
test: setup lint wasm
	scripts/previous-release.sh
	scripts/wasm.sh faulty
	cargo build -p idemgate-store
	@for f in envoy/*.yaml; do \
	    case $$f in envoy/_*|'envoy/*.yaml') continue;; esac; \
	    $(ENVOY) --mode validate --log-level warn -c $$f || exit 1; \
	done
	python3 scripts/validate-istio-payloads.py $(ENVOY)
	$(VENV)/bin/python scripts/validate-plugin-configs.py
	scripts/validate-manifests.sh
	scripts/oci-roundtrip.sh $(WASM)
	d=$$(mktemp -d) && RELEASE_OUT=$$d RELEASE_STORE=target/debug/idempotency-store RELEASE_PIN=no \
	    scripts/release.sh && rm -rf $$d
	$(E2E_ENV) IDEMGATE_PYTHON=$(VENV)/bin/python \
	IDEMGATE_PREVIOUS=$(CURDIR)/$$(scripts/previous-release.sh) \
	    cargo test --workspace --exclude e2e
	cargo test -p e2e --lib
	@# The end-to-end suites share one binary but run one suite at a time:
	@# a suite's timing-sensitive tests (a store restarted, a store slower
	@# than the filter) never share the two cores with another suite's.
	failed=; for suite in $$(sed -n 's/^mod \([a-z0-9_]*\);$$/\1/p' tests/tests/main.rs); do \
	    $(E2E_ENV) IDEMGATE_PYTHON=$(VENV)/bin/python \
	    IDEMGATE_PREVIOUS=$(CURDIR)/$$(scripts/previous-release.sh) \
	        cargo test -p e2e --test main -- $$suite:: || failed="$$failed $$suite"; \
	done; \
	if [ -n "$$failed" ]; then echo "failed suites:$$failed"; exit 1; fi
	@# The oldest Envoy the README names (1.36, scripts/setup.sh): detached
	@# forwarding, lost claims and the demo walkthrough.
	IDEMGATE_WASM=$(CURDIR)/$(WASM) \
	IDEMGATE_STORE_BIN=$(CURDIR)/target/debug/idempotency-store \
	ENVOY_BIN=$(CURDIR)/.tools/envoy-1.36/bin/envoy \
	    cargo test -p e2e --test main -- detached:: lost_claims::
	ENVOY_BIN=$(CURDIR)/.tools/envoy-1.36/bin/envoy scripts/demo-smoke.sh
	scripts/demo-smoke.sh
	IDEMGATE_REPORT=$(CURDIR)/docs/reliability.md scripts/fuzz.sh 25

fuzz: setup
	IDEMGATE_REPORT=$(CURDIR)/docs/reliability.md scripts/fuzz.sh $(FUZZ_SECONDS)

chaos: setup wasm
	@scripts/setup.sh chaos
	cargo build -p idemgate-store
	$(E2E_ENV) CHAOS_SECONDS=$(CHAOS_SECONDS) cargo test -p e2e --test main -- chaos:: --nocapture
	@# Patroni (with etcd) fails over on its own under the chaos traffic.
	$(E2E_ENV) cargo test -p e2e --test main -- patroni:: --ignored --nocapture
	@# The stores behind PgBouncer in transaction mode, PgBouncer restarted mid-run.
	$(E2E_ENV) cargo test -p e2e --test main -- pgbouncer:: --ignored --nocapture

# The soaks run the store's release build, as deployed.
soak: setup wasm
	cargo build --release -p idemgate-store
	$(E2E_ENV) IDEMGATE_STORE_BIN=$(CURDIR)/target/release/idempotency-store SOAK_SECONDS=$(SOAK_SECONDS) \
	    GROWTH_SECONDS=$(GROWTH_SECONDS) IDEMGATE_PYTHON=$(VENV)/bin/python \
	    cargo test -p e2e --test main -- --ignored chaos::soak growth::soak --nocapture --test-threads 1

demo: wasm
	@if [ -x scripts/demo.sh ]; then \
	    cargo build -p idemgate-store && scripts/demo.sh; \
	else echo "make demo: not yet"; fi

# Side-by-side benchmark (scripts/bench.sh): Envoy with and without the filter,
# the callout microbenchmark, the store on SQLite (new keys with streaming and
# with detached forwarding) and PostgreSQL, the replay path, the store at
# 10^5-10^7 records (BENCH_SCALE) with the sweeper catching up under load, gRPC
# new keys and replays beside a gRPC baseline (BENCH_ONLY=grpc runs those
# alone), and express-idempotency as the peer. Writes bench/results/ and the README's
# Performance section. Takes about 80 minutes (see scripts/bench.sh).
bench:
	@scripts/setup.sh bench
	@scripts/wasm.sh
	@scripts/wasm.sh callout
	cargo build --release -p idemgate-store -p idemgate-store-load
	@scripts/bench.sh

release: wasm
	cargo build --release -p idemgate-store
	@scripts/release.sh

clean:
	cargo clean
	rm -rf .demo
