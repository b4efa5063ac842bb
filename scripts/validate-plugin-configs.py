#!/usr/bin/env python3
"""Every filter configuration the repository ships, checked against the
published JSON Schema (docs/config.schema.json, generated from the filter's
configuration types and kept current by the e2e test config_schema).

    scripts/validate-plugin-configs.py

Looks in every YAML file under envoy/ and examples/: a Wasm filter's
`configuration` (a StringValue holding JSON) and a WasmPlugin's
`pluginConfig`, when they hold `store` and `policies`. Fails when one does not
validate, when none is found, or when the schema accepts a misspelt field.
Under examples/istio/ the store's token must come from the proxy's environment
(`store.token_env`, the variable set from a Secret), never `store.token`: an
EnvoyFilter or WasmPlugin is readable by whoever may read the mesh's config.
"""
import json
import os
import sys

import jsonschema
import yaml

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
STRING_VALUE = "type.googleapis.com/google.protobuf.StringValue"


def plugin_configs(node):
    """The filter configurations inside a parsed YAML document."""
    if isinstance(node, dict):
        conf = node.get("configuration")
        if isinstance(conf, dict) and conf.get("@type") == STRING_VALUE and isinstance(conf.get("value"), str):
            try:
                value = json.loads(conf["value"])
            except json.JSONDecodeError:
                value = None
            if isinstance(value, dict) and "policies" in value:
                yield value
        plugin = node.get("pluginConfig")
        if isinstance(plugin, dict) and "policies" in plugin:
            yield plugin
        for child in node.values():
            yield from plugin_configs(child)
    elif isinstance(node, list):
        for child in node:
            yield from plugin_configs(child)


def main():
    with open(os.path.join(ROOT, "docs", "config.schema.json")) as f:
        schema = json.load(f)
    validator = jsonschema.Draft202012Validator(schema)
    checked, failed = 0, 0
    for top in ("envoy", "examples"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "node_modules"]
            for name in sorted(filenames):
                if not name.endswith((".yaml", ".yml")):
                    continue
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    docs = list(yaml.safe_load_all(f))
                for doc in docs:
                    for config in plugin_configs(doc):
                        checked += 1
                        rel = os.path.relpath(path, ROOT)
                        if rel.startswith(os.path.join("examples", "istio") + os.sep):
                            store = config.get("store") if isinstance(config.get("store"), dict) else {}
                            if "token" in store or "token_env" not in store:
                                failed += 1
                                print(f"{rel}: store.token inline: in examples/istio the token comes "
                                      f"from the proxy's environment (store.token_env)", file=sys.stderr)
                        errors = sorted(validator.iter_errors(config), key=lambda e: list(e.path))
                        for e in errors:
                            failed += 1
                            where = "/".join(str(p) for p in e.path) or "(document)"
                            print(f"{os.path.relpath(path, ROOT)}: {where}: {e.message}", file=sys.stderr)
                        if not errors and checked == 1:
                            misspelt = json.loads(json.dumps(config))
                            misspelt["policies"][0]["ttl_secs"] = 60
                            if validator.is_valid(misspelt):
                                print("the schema accepts a misspelt policy field (ttl_secs)", file=sys.stderr)
                                failed += 1
    if checked == 0:
        print("no filter configuration found under envoy/ or examples/", file=sys.stderr)
        return 1
    print(f"{checked} filter configurations match docs/config.schema.json" if not failed else
          f"{failed} problems in {checked} filter configurations", file=sys.stderr if failed else sys.stdout)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
