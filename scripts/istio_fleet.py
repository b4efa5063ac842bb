"""What scripts/istio-workloads.py writes besides the EnvoyFilters: the
resources and Kustomize patches a fleet of protected workloads needs, from
the same policies file.

  workload side (a Kustomize Component an overlay holding the workloads'
  Deployments includes):
    - one EnvoyFilter per workload (envoy_filter);
    - the gRPC replay route (an HTTP_ROUTE EnvoyFilter) of each workload
      with gRPC policies, guarded by the filter's own proxyVersion;
    - per workload, a strategic-merge patch of its Deployment: the sidecar's
      drain (proxy.istio.io/config) and grace period derived from its
      policies, and the store token's environment variable on the
      istio-proxy container;
    - per workload that names a route to check, a CronJob running
      scripts/rollout-check.py against it (the script in a ConfigMap);
  store side (a Component the store's overlay includes):
    - the store's AuthorizationPolicy: each workload namespace may POST
      exactly the store paths its policies use (the gRPC replay method only
      where a policy is gRPC), operators the admin paths, anyone the probes;
    - the store's DestinationRule, upgraded to HTTP/2 when a policy is gRPC;
    - JSON patches of the store's NetworkPolicy and the sidecars' PodMonitor
      listing exactly the workloads' namespaces;
    - an ExternalSecret of the store token per workload namespace;
    - the coverage alerts (a PrometheusRule, and the same rules as a plain
      Prometheus rule file): a workload whose pods run without the filter.

Only the Python standard library and PyYAML.
"""
import copy
import json
import re

WASM = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
STRING_VALUE = "type.googleapis.com/google.protobuf.StringValue"
HEADER_MUTATION = "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
DEFAULT_PRIORITY = 10
# The paths the filter calls on the store (crates/core/src/protocol.rs), all POST.
STORE_API_PATHS = ["/v1/claim", "/v1/complete", "/v1/release", "/v1/mark-unknown",
                   "/v1/abandon", "/v1/batch"]
REPLAY_PATH = "/idemgate.v1.Store/Replay"
PROBE_PATHS = ["/healthz", "/readyz", "/metrics"]
ADMIN_PATHS = ["/admin/v1/*", "/admin/console", "/admin/console/*"]
DEFAULT_OPERATORS = ["cluster.local/ns/ops/sa/idempotency-operator"]
# The store's objects the store-side patches change (examples/kubernetes/base,
# examples/kubernetes/components/monitoring).
STORE_NETWORK_POLICY = "idempotency-store"
SIDECAR_POD_MONITOR = "idemgate-sidecars"
STORE_API_PORT = 8787
DEFAULT_TOKEN_SECRET = {"name": "idemgate-store-token", "key": "api-token"}
ROLLOUT_CHECK_CONFIGMAP = "idemgate-rollout-check"
ROLLOUT_CHECK_SCRIPT = "scripts/rollout-check.py"


def labels(instance, component):
    return {
        "app.kubernetes.io/name": "idemgate",
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "idemgate",
        "app.kubernetes.io/managed-by": "istio-workloads.py",
    }


def store_endpoint(store):
    """(service, namespace, port, host) of the store, from the filter's
    `store.cluster` (Istio's `outbound|<port>||<fqdn>`)."""
    m = re.match(r"^outbound\|(\d+)\|\|(([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.[a-z0-9.-]+)$",
                 str(store.get("cluster", "")))
    if not m:
        return None
    return m.group(3), m.group(4), int(m.group(1)), m.group(2)


def grpc_policies(workload):
    return [p for p in workload["policies"] if "grpc" in p]


def namespaces(spec):
    return sorted({w["namespace"] for w in spec["workloads"]})


def token_secret(spec):
    return dict(DEFAULT_TOKEN_SECRET, **{k: v for k, v in (spec.get("token_secret") or {}).items()
                                          if k in ("name", "key")})


def deployment_name(workload):
    return workload.get("deployment", workload["name"])


# --- the workload side -------------------------------------------------------

def plugin_json(plugin):
    """The plugin configuration as JSON, the store and each policy on a line."""
    policies = ",\n".join(f"    {json.dumps(p)}" for p in plugin["policies"])
    return (f'{{\n  "store": {json.dumps(plugin["store"])},\n'
            f'  "policies": [\n{policies}\n  ]\n}}\n')


def sidecar_inbound(proxy, http_filter=None):
    """The match of a patch to the inbound HTTP connection manager of the
    sidecars `proxy` admits; relative to `http_filter` when one is named."""
    manager = {"name": "envoy.filters.network.http_connection_manager"}
    if http_filter:
        manager["subFilter"] = {"name": http_filter}
    return {
        "context": "SIDECAR_INBOUND",
        "proxy": dict(proxy),
        "listener": {"filterChain": {"filter": manager}},
    }


def envoy_filter(workload, spec, uri, sha256, regex, literal=str):
    ns, name = workload["namespace"], workload["name"]
    ecds = f"envoyfilter.{ns}.idemgate-{name}"
    token_env = spec["store"]["token_env"]
    plugin = {"store": copy.deepcopy(spec["store"]), "policies": copy.deepcopy(workload["policies"])}
    proxy = {"proxyVersion": regex}
    return {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": {
            "name": f"idemgate-{name}",
            "namespace": ns,
            "labels": {
                "app.kubernetes.io/name": "idemgate",
                "app.kubernetes.io/instance": name,
                "app.kubernetes.io/component": "filter",
                "app.kubernetes.io/part-of": "idemgate",
                "app.kubernetes.io/managed-by": "istio-workloads.py",
            },
        },
        "spec": {
            "workloadSelector": {"labels": dict(workload["selector"])},
            "priority": int(spec.get("priority", DEFAULT_PRIORITY)),
            "configPatches": [
                {
                    "applyTo": "EXTENSION_CONFIG",
                    "match": {"proxy": dict(proxy)},
                    "patch": {"operation": "ADD", "value": {
                        "name": ecds,
                        "typed_config": {
                            "@type": WASM,
                            "config": {
                                "name": "idemgate",
                                "root_id": "idemgate",
                                "allow_on_headers_stop_iteration": True,
                                "failure_policy": "FAIL_RELOAD",
                                "vm_config": {
                                    "vm_id": "idemgate",
                                    "runtime": "envoy.wasm.runtime.v8",
                                    "code": {"remote": {
                                        "http_uri": {"uri": uri, "cluster": "_", "timeout": "30s"},
                                        "sha256": sha256,
                                    }},
                                    "environment_variables": {"host_env_keys": [token_env]},
                                },
                                "configuration": {
                                    "@type": STRING_VALUE,
                                    "value": literal(plugin_json(plugin)),
                                },
                            },
                        },
                    }},
                },
                {
                    "applyTo": "HTTP_FILTER",
                    "match": sidecar_inbound(proxy, "envoy.filters.http.router"),
                    "patch": {"operation": "INSERT_BEFORE", "value": {
                        "name": ecds,
                        "config_discovery": {
                            "config_source": {"ads": {}, "initial_fetch_timeout": "0s"},
                            "type_urls": [WASM],
                        },
                    }},
                },
                {
                    "applyTo": "HTTP_FILTER",
                    "match": sidecar_inbound(proxy),
                    "patch": {"operation": "INSERT_FIRST", "value": {
                        "name": "idemgate.strip-identity-headers",
                        "typed_config": {
                            "@type": HEADER_MUTATION,
                            "mutations": {"request_mutations": [
                                {"remove": "x-tenant-id"},
                                {"remove": "x-user-id"},
                            ]},
                        },
                    }},
                },
            ],
        },
    }



def replay_filter(workload, spec, regex):
    """The replay route of a workload with gRPC policies (docs/contract.md
    §10), as examples/istio/grpc-replay.yaml writes it by hand."""
    return {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": {"name": f"idemgate-{workload['name']}-grpc-replay", "namespace": workload["namespace"],
                     "labels": labels(workload["name"], "grpc-replay")},
        "spec": {
            "workloadSelector": {"labels": dict(workload["selector"])},
            # After the filter's own EnvoyFilter: INSERT_FIRST is not
            # relative, but the order is then the same on every proxy.
            "priority": int(spec.get("priority", DEFAULT_PRIORITY)) + 10,
            "configPatches": [{
                "applyTo": "HTTP_ROUTE",
                "match": {
                    "context": "SIDECAR_INBOUND",
                    "proxy": {"proxyVersion": regex},
                    "routeConfiguration": {"portNumber": int(workload["grpc_port"])},
                },
                "patch": {"operation": "INSERT_FIRST", "value": {
                    "name": "idemgate-grpc-replay",
                    "match": {
                        "path": REPLAY_PATH,
                        "headers": [{"name": "x-idemgate-replay", "present_match": True}],
                    },
                    "route": {
                        "cluster": spec["store"]["cluster"],
                        "timeout": "5s",
                        "retry_policy": {"num_retries": 0},
                    },
                }},
            }],
        },
    }


def pod_patch(workload, spec, settings):
    """The workload's Deployment, as a strategic-merge patch: the sidecar's
    stop and the token's environment on the istio-proxy container (Istio's
    injection merges a container of that name into the sidecar it adds)."""
    secret = token_secret(spec)
    proxy_config = (f"terminationDrainDuration: {settings['terminationDrainDuration']}\n"
                    "proxyMetadata:\n"
                    f"  EXIT_ON_ZERO_ACTIVE_CONNECTIONS: \"{settings['EXIT_ON_ZERO_ACTIVE_CONNECTIONS']}\"\n")
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": deployment_name(workload), "namespace": workload["namespace"]},
        "spec": {"template": {
            "metadata": {"annotations": {"proxy.istio.io/config": proxy_config}},
            "spec": {
                "terminationGracePeriodSeconds": settings["terminationGracePeriodSeconds"],
                "containers": [{
                    "name": "istio-proxy",
                    "image": "auto",
                    "env": [{"name": spec["store"]["token_env"],
                             "valueFrom": {"secretKeyRef": {"name": secret["name"], "key": secret["key"]}}}],
                }],
            },
        }},
    }


def rollout_check_configmap(namespace, script):
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": ROLLOUT_CHECK_CONFIGMAP, "namespace": namespace,
                     "labels": labels("rollout-check", "rollout-check")},
        "data": {"rollout-check.py": script},
    }


def rollout_check_cronjob(workload, spec):
    """A CronJob that runs scripts/rollout-check.py against the workload's
    route as its test identity; a failed check fails the Job (exit 1,
    backoffLimit 0). A pipeline gates on a run of it:
    kubectl create job --from=cronjob/<name> <run> && kubectl wait --for=condition=complete."""
    check = workload["rollout_check"]
    name = f"idemgate-rollout-check-{workload['name']}"
    args = ["/opt/rollout-check/rollout-check.py", check["url"]]
    env = []
    if check.get("token_secret"):
        env.append({"name": "ROLLOUT_CHECK_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": check["token_secret"]["name"], "key": check["token_secret"]["key"]}}})
        args += ["-H", "authorization: Bearer $(ROLLOUT_CHECK_TOKEN)"]
    for h in check.get("headers", []):
        args += ["-H", h]
    if check.get("optional_key"):
        args.append("--optional-key")
    container = {
        "name": "rollout-check",
        "image": spec["rollout_check_image"],
        "command": ["python3"],
        "args": args,
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "script", "mountPath": "/opt/rollout-check", "readOnly": True}],
    }
    if env:
        container["env"] = env
    meta_labels = labels(workload["name"], "rollout-check")
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": {"name": name, "namespace": workload["namespace"], "labels": meta_labels},
        "spec": {
            "schedule": check.get("schedule", "*/30 * * * *"),
            "concurrencyPolicy": "Forbid",
            "successfulJobsHistoryLimit": 3,
            "failedJobsHistoryLimit": 3,
            "jobTemplate": {"spec": {
                # A failed check is a verdict, not a flake to retry.
                "backoffLimit": 0,
                "activeDeadlineSeconds": 300,
                "ttlSecondsAfterFinished": 86400,
                "template": {
                    "metadata": {
                        "labels": meta_labels,
                        # In the mesh (the route is behind mTLS), and a native
                        # sidecar (Istio 1.24+), which stops when the check
                        # exits instead of keeping the Job's pod running.
                        "annotations": {"sidecar.istio.io/nativeSidecar": "true"},
                    },
                    "spec": {
                        "restartPolicy": "Never",
                        "automountServiceAccountToken": False,
                        "securityContext": {"runAsNonRoot": True, "runAsUser": 65534, "runAsGroup": 65534,
                                            "seccompProfile": {"type": "RuntimeDefault"}},
                        "containers": [container],
                        "volumes": [{"name": "script", "configMap": {"name": ROLLOUT_CHECK_CONFIGMAP}}],
                    },
                },
            }},
        },
    }


# --- the store side ----------------------------------------------------------

def authorization_policy(spec):
    """Who may call what on the store: each workload namespace exactly the
    paths its filter calls (POST), the replay method only from namespaces
    with gRPC policies; operators the admin surface; anyone the probes."""
    service, ns, _, _ = store_endpoint(spec["store"])
    grpc = sorted({w["namespace"] for w in spec["workloads"] if grpc_policies(w)})
    http_only = [n for n in namespaces(spec) if n not in grpc]
    rules = []
    if http_only:
        rules.append({"from": [{"source": {"namespaces": http_only}}],
                      "to": [{"operation": {"methods": ["POST"], "paths": list(STORE_API_PATHS)}}]})
    if grpc:
        rules.append({"from": [{"source": {"namespaces": grpc}}],
                      "to": [{"operation": {"methods": ["POST"], "paths": STORE_API_PATHS + [REPLAY_PATH]}}]})
    rules.append({"from": [{"source": {"principals": list(spec.get("operators", DEFAULT_OPERATORS))}}],
                  "to": [{"operation": {"paths": list(ADMIN_PATHS)}}]})
    rules.append({"to": [{"operation": {"methods": ["GET"], "paths": list(PROBE_PATHS)}}]})
    return {
        "apiVersion": "security.istio.io/v1",
        "kind": "AuthorizationPolicy",
        "metadata": {"name": service, "namespace": ns, "labels": labels(service, "authorization")},
        "spec": {"selector": {"matchLabels": {"app": service}}, "action": "ALLOW", "rules": rules},
    }


def destination_rule(spec):
    """The store's DestinationRule: mTLS, outlier detection, and HTTP/2
    when a policy is gRPC (the replay's trailers need it). One rule for the
    host: Istio takes the traffic policy of only one DestinationRule per
    host, so this one replaces examples/istio/traffic.yaml's."""
    service, ns, _, host = store_endpoint(spec["store"])
    policy = {
        "tls": {"mode": "ISTIO_MUTUAL"},
        "outlierDetection": {"consecutive5xxErrors": 5, "interval": "10s", "baseEjectionTime": "30s"},
    }
    if any(grpc_policies(w) for w in spec["workloads"]):
        policy["connectionPool"] = {"http": {"h2UpgradePolicy": "UPGRADE"}}
    return {
        "apiVersion": "networking.istio.io/v1",
        "kind": "DestinationRule",
        "metadata": {"name": service, "namespace": ns, "labels": labels(service, "traffic")},
        "spec": {"host": host, "trafficPolicy": policy},
    }


def network_policy_patch(spec):
    """JSON patch of the store's NetworkPolicy: its API rule (the first)
    admits the workloads' namespaces, by name, and no others."""
    return [
        {"op": "test", "path": "/spec/ingress/0/ports/0/port", "value": STORE_API_PORT},
        {"op": "replace", "path": "/spec/ingress/0/from", "value": [{"namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": namespaces(spec)}]}}]},
    ]


def pod_monitor_patch(spec):
    """JSON patch of the sidecars' PodMonitor: the workloads' namespaces."""
    return [{"op": "replace", "path": "/spec/namespaceSelector/matchNames", "value": namespaces(spec)}]


def external_secrets(spec):
    """The store token in each workload namespace, from the remote property
    the store's own Secret reads (when the policies file names it)."""
    secret = token_secret(spec)
    remote = (spec.get("token_secret") or {}).get("external_secret")
    if not remote:
        return []
    out = []
    for ns in namespaces(spec):
        out.append({
            "apiVersion": "external-secrets.io/v1",
            "kind": "ExternalSecret",
            "metadata": {"name": secret["name"], "namespace": ns,
                         "labels": labels(secret["name"], "client-credentials")},
            "spec": {
                "refreshInterval": "1h",
                "secretStoreRef": {"kind": "ClusterSecretStore", "name": remote["store"]},
                "target": {"name": secret["name"], "creationPolicy": "Owner", "deletionPolicy": "Retain"},
                "data": [{"secretKey": secret["key"],
                          "remoteRef": {"key": remote["key"], "property": remote["property"]}}],
            },
        })
    return out


# --- coverage alerts ---------------------------------------------------------

def relabeled_policy(name):
    """A policy's name as the `policy` label reads on a sidecar (the
    relabeling of examples/monitoring/prometheus.yml): punctuation is `_` in
    Envoy's flat stat name, and the last 8 `_` with a character on each
    side read `.`."""
    flat = re.sub(r"[^A-Za-z0-9_]", "_", name)
    for _ in range(8):
        flat = re.sub(r"^(.+)_(.+)$", r"\1.\2", flat)
    return flat


def pod_label(key):
    """kube-state-metrics' label for a pod label key (kube_pod_labels)."""
    return "label_" + re.sub(r"[^A-Za-z0-9_]", "_", key)


def promql_string(value):
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def coverage_rules(spec, literal=str):
    """The rule groups that make a gap loud, one pair of alerts per
    workload of the policies file:

    IdemgateWorkloadPodsUnprotected: a Running pod the workload's selector
      selects (kube-state-metrics' kube_pod_labels; its
      --metric-labels-allowlist must list the selector's keys) that does not
      report every one of the workload's policies loaded
      (idemgate_policy_info == 1 on that pod): a sidecar of an Istio minor
      the EnvoyFilter's proxyVersion does not admit, a pod without a
      sidecar, a module that did not load.
    IdemgatePolicyNotReported: no pod of the namespace reports the policy at
      all (needs nothing but the sidecars' scrape): the whole workload is
      unprotected, or its sidecars are not scraped.
    """
    rules = []
    for w in spec["workloads"]:
        ns, wl = w["namespace"], f"{w['namespace']}/{w['name']}"
        names = [relabeled_policy(p.get("name", "")) for p in w["policies"]]
        policy_re = "|".join(re.escape(n) for n in names)
        selector = ", ".join(f"{pod_label(k)}={promql_string(v)}" for k, v in sorted(w["selector"].items()))
        expr = (
            f"(\n"
            f"  max by (namespace, pod) (kube_pod_labels{{namespace={promql_string(ns)}, {selector}}})\n"
            f"  * on (namespace, pod) group_left ()\n"
            f"  max by (namespace, pod) (kube_pod_status_phase{{namespace={promql_string(ns)}, phase=\"Running\"}} == 1)\n"
            f")\n"
            f"unless on (namespace, pod)\n"
            f"(\n"
            f"  count by (namespace, pod) (\n"
            f"    group by (namespace, pod, policy) (idemgate_policy_info{{namespace={promql_string(ns)}, "
            f"policy=~{promql_string(policy_re)}}} == 1)\n"
            f"  ) == {len(names)}\n"
            f")\n"
        )
        rules.append({
            "alert": "IdemgateWorkloadPodsUnprotected",
            "expr": literal(expr),
            "for": "5m",
            "labels": {"severity": "critical", "workload": wl},
            "annotations": {
                "summary": f"Pod {{{{ $labels.pod }}}} of {wl} runs without idemgate's filter",
                "description": (
                    f"The pod is selected by workload {wl} of the policies file, but its sidecar does not "
                    f"report every one of the workload's policies loaded ({', '.join(names)}): requests "
                    "those policies cover pass unprotected (no idempotency). Usual causes: the sidecar's "
                    "Istio minor is not admitted by the EnvoyFilter's proxyVersion (an Istio upgrade or a "
                    "canary revision), the pod has no sidecar, or the module did not load. Check with "
                    "istioctl proxy-config listener <pod> -o json | grep envoyfilter."),
                "runbook_url": "https://idemgate.dev/docs/rollout#7-a-workload-without-the-filter",
            },
        })
        for name in names:
            rules.append({
                "alert": "IdemgatePolicyNotReported",
                "expr": (f"absent(idemgate_policy_info{{namespace={promql_string(ns)}, "
                         f"policy={promql_string(name)}}} == 1)"),
                "for": "10m",
                # absent() of a comparison carries no labels of its own.
                "labels": {"severity": "critical", "workload": wl, "namespace": ns, "policy": name},
                "annotations": {
                    "summary": f"No sidecar of {wl} runs policy {name}",
                    "description": (
                        f"No pod in namespace {ns} reports policy {name} loaded (idemgate_policy_info), "
                        f"although workload {wl} of the policies file names it: either none of its "
                        "sidecars runs the filter (Istio minor not admitted, EnvoyFilter missing, module "
                        "not loaded) or the sidecars are not scraped (the PodMonitor's namespaces)."),
                    "runbook_url": "https://idemgate.dev/docs/rollout#7-a-workload-without-the-filter",
                },
            })
    return [{"name": "idemgate-coverage", "rules": rules}]


def prometheus_rule(spec, literal=str):
    _, ns, _, _ = store_endpoint(spec["store"])
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "idemgate-coverage", "namespace": ns, "labels": labels("idemgate-coverage", "monitoring")},
        "spec": {"groups": coverage_rules(spec, literal)},
    }
