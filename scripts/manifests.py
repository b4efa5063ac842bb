"""Reading YAML and writing generated manifests, for the generators in
scripts/ (monitoring-crds.py: one output file, written or checked against
what the generator writes today, --check, as scripts/validate-manifests.sh
runs it; istio-workloads.py reads with it and writes a directory, checked by
scripts/istio_drift.py). Only the Python standard library
and PyYAML.
"""
import os
import sys

import yaml

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def load(path):
    """The one YAML document of the file at `path`."""
    with open(path) as f:
        return yaml.safe_load(f)


def load_all(path):
    """The YAML documents of the file at `path`, empty ones left out."""
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def write(tool, shown, path, text):
    """Writes `text` to `path` (named `shown` in the message): exit code 0."""
    with open(path, "w") as f:
        f.write(text)
    print(f"{tool}: wrote {shown}")
    return 0


def check(tool, shown, path, text, sources, regenerate):
    """Exit code 0 when the file at `path` (named `shown`) holds exactly
    `text`, what `sources` generate; 1, naming the `regenerate` command, when
    it is missing or holds anything else."""
    try:
        with open(path) as f:
            current = f.read()
    except FileNotFoundError:
        current = None
    origin = " and ".join(sources)
    if current != text:
        verb = "generate" if len(sources) > 1 else "generates"
        print(f"{tool}: {shown} is not what {origin} {verb}; run {regenerate}", file=sys.stderr)
        return 1
    print(f"{tool}: {shown} is up to date with {origin}")
    return 0
