#!/usr/bin/env bash
# Runs the demo exactly as examples/README.md tells a reader to, and checks it:
#
#   1. `make demo` in the background (its own process group, output to a log);
#   2. polls until Envoy, the store and the upstream answer;
#   3. runs every ```sh block of examples/README.md in order, in one shell, and
#      compares each answer with the ```http / ```json / ```text block after it
#      (status line, the headers shown, the body; `…` matches anything);
#   4. stops the demo the way Ctrl-C does (SIGINT to make's process group) and
#      checks that no process of it is left and its ports are free.
#
#   scripts/demo-smoke.sh                 log: target/demo-smoke.log
#   DEMO_SMOKE_START_TIMEOUT=1800 scripts/demo-smoke.sh   (first run builds everything)
set -euo pipefail
cd "$(dirname "$0")/.."

LOG=target/demo-smoke.log
WALKTHROUGH=examples/README.md
PORTS=(10000 9901 8787 8080)
START_TIMEOUT=${DEMO_SMOKE_START_TIMEOUT:-1200}

say() { printf 'demo-smoke: %s\n' "$*"; }
fail() {
    say "FAIL: $*" >&2
    exit 1
}
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

for port in "${PORTS[@]}"; do
    port_open "$port" && fail "port $port is already in use; stop whatever runs there (another demo?) first"
done

mkdir -p target
# Job control on: `make demo` gets its own process group, which is what a
# terminal's Ctrl-C signals, and (unlike a plain background job) does not
# start with SIGINT ignored.
set -m
make demo >"$LOG" 2>&1 &
pgid=$!
set +m

stopped=0
stop_demo() {
    ((stopped)) && return 0
    stopped=1
    kill -INT -- "-$pgid" 2>/dev/null || true
    local i
    for ((i = 0; i < 200; i++)); do
        kill -0 "$pgid" 2>/dev/null || break
        sleep 0.1
    done
    wait "$pgid" 2>/dev/null || true
}
on_exit() {
    local rc=$?
    if ((!stopped)); then
        stop_demo
        pkill -KILL -g "$pgid" 2>/dev/null || true
    fi
    if ((rc != 0)); then
        say "the demo's log ($LOG), last 60 lines:" >&2
        tail -n 60 "$LOG" >&2 || true
    fi
}
trap on_exit EXIT

say "starting \`make demo\` (log: $LOG)"
deadline=$((SECONDS + START_TIMEOUT))
until grep -q '^\[demo\] ready' "$LOG" 2>/dev/null &&
    curl -fsS -o /dev/null --max-time 2 http://127.0.0.1:9901/ready &&
    curl -fsS -o /dev/null --max-time 2 http://127.0.0.1:8787/readyz &&
    curl -fsS -o /dev/null --max-time 2 http://127.0.0.1:8080/_demo/executions; do
    kill -0 "$pgid" 2>/dev/null || fail "\`make demo\` exited before it was ready"
    ((SECONDS < deadline)) || fail "the demo was not ready within ${START_TIMEOUT}s"
    sleep 0.5
done
say "ready; running the walkthrough in $WALKTHROUGH"

pids=()
for name in store payments envoy; do
    [[ -s .demo/$name.pid ]] || fail ".demo/$name.pid is missing"
    pids+=("$(cat ".demo/$name.pid")")
done

python3 - "$WALKTHROUGH" <<'PY'
"""Runs the ```sh blocks of a walkthrough and checks the answers shown after them."""
import json
import re
import subprocess
import sys

WILD = "…"
text = open(sys.argv[1], encoding="utf-8").read()
blocks = re.findall(r"^```(\w*)\n(.*?)^```\s*$", text, re.M | re.S)

steps = []  # (command, kind, expected)
i = 0
while i < len(blocks):
    lang, body = blocks[i]
    if lang == "sh":
        kind, expected = None, None
        if i + 1 < len(blocks) and blocks[i + 1][0] in ("http", "json", "text"):
            kind, expected = blocks[i + 1]
            i += 1
        steps.append((body, kind, expected))
    i += 1
if not steps:
    sys.exit("no ```sh blocks found")

script = ["set -u"]
for n, (command, _, _) in enumerate(steps):
    script.append(f"printf '\\n@@step {n}@@\\n'")
    script.append(command)
script.append("printf '\\n@@end@@\\n'")
run = subprocess.run(["bash", "-c", "\n".join(script)], capture_output=True, stdin=subprocess.DEVNULL, timeout=600)
out = run.stdout.decode("utf-8", "replace").replace("\r\n", "\n")
parts = re.split(r"\n@@step (\d+)@@\n", out)
outputs = {int(parts[k]): parts[k + 1] for k in range(1, len(parts) - 1, 2)}
if "@@end@@" not in out:
    sys.exit(f"the walkthrough did not run to its end; stderr:\n{run.stderr.decode('utf-8', 'replace')}")
outputs[len(steps) - 1] = outputs.get(len(steps) - 1, "").split("\n@@end@@")[0]


def glob(pattern, value):
    rx = ".*".join(re.escape(p) for p in pattern.split(WILD))
    return re.fullmatch(rx, value, re.S) is not None


def same_json(want, got):
    if want == WILD:
        return True
    if isinstance(want, str) and isinstance(got, str):
        return glob(want, got)
    if isinstance(want, dict):
        return isinstance(got, dict) and want.keys() == got.keys() and all(same_json(want[k], got[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(want) == len(got) and all(map(same_json, want, got))
    return type(want) is type(got) and want == got


def same_body(want, got):
    want, got = want.strip(), got.strip()
    try:
        return same_json(json.loads(want), json.loads(got))
    except ValueError:
        return glob(want, got)


def check_http(want, got):
    problems = []
    want_head, _, want_body = want.partition("\n\n")
    got_head, _, got_body = got.strip("\n").partition("\n\n")
    want_lines, got_lines = want_head.strip().split("\n"), got_head.split("\n")
    if want_lines[0].strip() != got_lines[0].strip():
        problems.append(f"status line: want {want_lines[0]!r}, got {got_lines[0]!r}")
    headers = {}
    for line in got_lines[1:]:
        name, _, value = line.partition(":")
        headers.setdefault(name.strip().lower(), []).append(value.strip())
    for line in want_lines[1:]:
        name, _, value = line.partition(":")
        values = headers.get(name.strip().lower(), [])
        if not any(glob(value.strip(), v) for v in values):
            problems.append(f"header {name.strip()}: want {value.strip()!r}, got {values}")
    # The contract: this header never reaches a client.
    if "idempotency-control" in headers:
        problems.append("idempotency-control reached the client")
    if want_body.strip() and not same_body(want_body, got_body):
        problems.append(f"body: want {want_body.strip()!r}, got {got_body.strip()[:400]!r}")
    return problems


failures = 0
for n, (command, kind, expected) in enumerate(steps):
    got = outputs.get(n, "")
    first = command.strip().split("\n")[0][:100]
    if kind is None:
        problems = []
    elif kind == "http":
        problems = check_http(expected, got)
    elif not same_body(expected, got):
        problems = [f"want {expected.strip()!r}, got {got.strip()[:400]!r}"]
    else:
        problems = []
    print(f"{'ok  ' if not problems else 'FAIL'} step {n + 1:2}: {first}")
    for p in problems:
        print(f"        {p}")
    failures += bool(problems)
if failures:
    sys.stderr.write(run.stderr.decode("utf-8", "replace"))
    sys.exit(f"{failures} of {len(steps)} walkthrough steps did not give the answer shown")
print(f"all {len(steps)} walkthrough steps gave the answer shown")
PY

say "stopping the demo with SIGINT to make's process group (as Ctrl-C does)"
stop_demo
kill -0 "$pgid" 2>/dev/null && fail "make is still running 20 s after SIGINT"
for ((i = 0; i < 50; i++)); do # exited children may take a moment to be reaped
    left=$(pgrep -g "$pgid" || true)
    [[ -z $left ]] && break
    sleep 0.1
done
[[ -z $left ]] || fail "processes of the demo are still running: $(ps -o pid=,args= -p "${left//$'\n'/,}")"
for pid in "${pids[@]}"; do
    kill -0 "$pid" 2>/dev/null && fail "process $pid ($(ps -o args= -p "$pid")) is still running"
done
for port in "${PORTS[@]}"; do
    port_open "$port" && fail "port $port is still open"
done
grep -q '^\[demo\] stopped' "$LOG" || fail "the demo did not report that it stopped"
say "ok: walkthrough as documented; after SIGINT nothing is left running and ports ${PORTS[*]} are free"
