# idemgate: the front door.
#   make check   the inner loop (under a minute warm): formatting, clippy, the
#                core's tests, the simulation's fixed set, the store's unit tests
#                and SQLite stories; no Envoy, no PostgreSQL
#   make explore new simulation scenarios on every core for EXPLORE_MINUTES (10),
#                until one breaks a promise (EXPLORE_ARGS: --all goes on, --seed S)
#   make demo    watch the filter at work in a real Envoy
#   make test    everything CI runs: lint, wasm build, bootstrap validation, tests
#                (with 20 s chaos runs and 25 s per fuzz target); prints each
#                stage's time at the end
#   make report  make test, writing its rows of docs/reliability.md
#   make fuzz    each fuzz target for FUZZ_SECONDS (300)
#   make chaos   the chaos runs for CHAOS_SECONDS (60) each
#   make release target/release-artefacts/: the module and its sha256, the module
#                as OCI image layouts, the release store binary; pins examples/istio
#   make soak    10 minutes at moderate load, then 30 minutes on millions of
#                records with the sweeper at work; memory, WAL, errors (not in CI)
#   make compat  the bootstraps, the Istio payloads, the detached, lost-claim and
#                gRPC suites and the demo walkthrough on every Envoy minor the
#                Istio manifests admit (1.36 to 1.40), then a table minor x suite
#                (not in CI)
# report, fuzz, chaos and soak write their rows of docs/reliability.md.
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
EXPLORE_MINUTES ?= 10
EXPLORE_ARGS ?=
GROWTH_SECONDS ?= 1800

.PHONY: setup wasm build check lint test report demo bench clean fuzz chaos soak release compat explore
.NOTPARALLEL:

setup:
	@scripts/setup.sh

wasm: setup
	@scripts/wasm.sh

build: setup
	cargo build --workspace
	@scripts/wasm.sh

# The stages, their order and their timing: scripts/test.sh.
check:
	@scripts/test.sh check

lint: setup
	@scripts/test.sh lint

test:
	@scripts/test.sh test

# make test, writing its rows of docs/reliability.md.
report:
	@IDEMGATE_REPORT=$(CURDIR)/docs/reliability.md scripts/test.sh test

# The simulation's scenarios drawn afresh (crates/simulation/src/bin/explore.rs);
# a violation prints the scenario whole, to be kept in its regressions.rs.
explore:
	cargo run --release -p idemgate-simulation --bin explore -- --minutes $(EXPLORE_MINUTES) $(EXPLORE_ARGS)

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
	cargo build -p e2e --bin idemgate-stack
	@scripts/bench.sh

# Every Envoy minor that an Istio minor the manifests admit ships
# (examples/istio/README.md, "Istio versions"), each from its own virtualenv
# (scripts/setup.sh compat): scripts/compat.sh prints which passed.
# COMPAT_MINORS="1.37 1.39" runs only those, COMPAT_SUITES="grpc demo" only those suites.
compat:
	@scripts/setup.sh compat
	@scripts/wasm.sh
	cargo build -p idemgate-store
	@scripts/compat.sh $(COMPAT_MINORS)

release: wasm
	cargo build --release -p idemgate-store
	@scripts/release.sh

clean:
	cargo clean
	rm -rf .demo
