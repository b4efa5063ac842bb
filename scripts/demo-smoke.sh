#!/usr/bin/env bash
# Runs the demo exactly as examples/README.md tells a reader to, and checks it:
#
#   1. `make demo` in the background (its own process group, output to a log);
#   2. waits until it is ready: the harness it runs (idemgate-stack demo)
#      checked that Envoy, the store and the upstreams (payments, the gRPC
#      ledger) answer, and wrote their addresses and PIDs to .demo/stack.json;
#   3. runs every ```sh block of examples/README.md in order, in one shell, and
#      compares each answer with the ```http / ```json / ```text block after it
#      (status line, the headers shown, the body; `…` matches anything); then
#      the same for the gRPC walkthrough, examples/ledger/README.md;
#   4. checks the gRPC step: the commands `make demo` prints are the ones the
#      gRPC walkthrough runs, and their answers say what the step promises (the
#      retry is a replay, another body under the key is KEY_REUSED, the ledger
#      executed the key once);
#   5. checks that Envoy's calls to the store went through the store's Unix
#      socket (`.demo/store.sock`, a `pipe` address);
#   6. stops the demo the way Ctrl-C does (SIGINT to make's process group) and
#      checks that no process of it is left and Envoy's and the store's ports
#      are free.
#
#   scripts/demo-smoke.sh                 log: target/demo-smoke.log
#   DEMO_SMOKE_START_TIMEOUT=1800 scripts/demo-smoke.sh   (first run builds everything)
set -euo pipefail
cd "$(dirname "$0")/.."

LOG=target/demo-smoke.log
WALKTHROUGH=examples/README.md
GRPC_WALKTHROUGH=examples/ledger/README.md
OUTPUTS=target/demo-smoke-steps.json # each step's command and answer, for step 4
STACK=.demo/stack.json
START_TIMEOUT=${DEMO_SMOKE_START_TIMEOUT:-1200}

say() { printf 'demo-smoke: %s\n' "$*"; }
fail() {
    say "FAIL: $*" >&2
    exit 1
}
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
stack() { # a Python expression over the stack's JSON (s) -> its value(s), one a line
    python3 -c 'import json, sys
s = json.load(open(sys.argv[1]))
v = eval(sys.argv[2])
print("\n".join(map(str, v)) if isinstance(v, list) else v)' "$STACK" "$1"
}

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
until grep -q '^\[demo\] ready' "$LOG" 2>/dev/null && [[ -s $STACK ]]; do
    kill -0 "$pgid" 2>/dev/null || fail "\`make demo\` exited before it was ready"
    ((SECONDS < deadline)) || fail "the demo was not ready within ${START_TIMEOUT}s"
    sleep 0.5
done
say "ready; running the walkthroughs in $WALKTHROUGH and $GRPC_WALKTHROUGH"

mapfile -t pids < <(stack '[s["envoy"]["pid"]] + [r["pid"] for r in s["stores"]] + [p["pid"] for p in s["services"].values()]')
mapfile -t ports < <(stack '[s["envoy"]["port"], s["envoy"]["admin"]] + [r["port"] for r in s["stores"]]')
admin=$(stack 's["envoy"]["admin"]')
((${#pids[@]} == 4)) || fail "$STACK names ${#pids[@]} processes, not 4 (Envoy, the store, payments, the ledger)"

rm -f "$OUTPUTS"
python3 - "$OUTPUTS" "$WALKTHROUGH" "$GRPC_WALKTHROUGH" <<'PY'
"""Runs the ```sh blocks of each walkthrough (one shell per page) and checks
the answers shown after them; writes each step's command and answer to the
file named first."""
import json
import re
import subprocess
import sys

WILD = "…"


def steps_of(path):
    """(command, kind, expected) for each ```sh block of a page."""
    text = open(path, encoding="utf-8").read()
    blocks = re.findall(r"^```(\w*)\n(.*?)^```\s*$", text, re.M | re.S)
    steps = []
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
        sys.exit(f"{path}: no ```sh blocks found")
    return steps


def run(path, steps):
    """Runs a page's steps in one shell; the output of each."""
    script = ["set -u"]
    for n, (command, _, _) in enumerate(steps):
        script.append(f"printf '\\n@@step {n}@@\\n'")
        script.append(command)
    script.append("printf '\\n@@end@@\\n'")
    run = subprocess.run(["bash", "-c", "\n".join(script)], capture_output=True, stdin=subprocess.DEVNULL, timeout=600)
    out = run.stdout.decode("utf-8", "replace").replace("\r\n", "\n")
    parts = re.split(r"\n@@step (\d+)@@\n", out)
    outputs = {int(parts[k]): parts[k + 1] for k in range(1, len(parts) - 1, 2)}
    stderr = run.stderr.decode("utf-8", "replace")
    if "@@end@@" not in out:
        sys.exit(f"{path}: the walkthrough did not run to its end; stderr:\n{stderr}")
    outputs[len(steps) - 1] = outputs.get(len(steps) - 1, "").split("\n@@end@@")[0]
    return outputs, stderr


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


record, failures, total = {}, 0, 0
for path in sys.argv[2:]:
    steps = steps_of(path)
    outputs, stderr = run(path, steps)
    record[path] = [[command, outputs.get(n, "")] for n, (command, _, _) in enumerate(steps)]
    print(f"{path}:")
    failed = 0
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
        failed += bool(problems)
    if failed:
        sys.stderr.write(stderr)
    failures += failed
    total += len(steps)
with open(sys.argv[1], "w", encoding="utf-8") as f:
    json.dump(record, f)
if failures:
    sys.exit(f"{failures} of {total} walkthrough steps did not give the answer shown")
print(f"all {total} walkthrough steps gave the answer shown")
PY

say "checking the gRPC step that \`make demo\` prints"
python3 - "$LOG" "$OUTPUTS" "$GRPC_WALKTHROUGH" <<'PY'
"""The gRPC step: what `make demo` prints is what the gRPC walkthrough ran,
and the answers keep the promise: a transfer executes once, its retry is a
replay, the same key with another body is refused with KEY_REUSED."""
import json
import re
import sys

log, outputs, page = sys.argv[1], json.load(open(sys.argv[2], encoding="utf-8")), sys.argv[3]
problems = []


def normal(command):
    """A command as one line: continuations joined, comments and spacing dropped."""
    command = re.sub(r"\\\n", " ", command)
    command = re.sub(r"\s+#.*$", "", command.strip(), flags=re.M)
    return " ".join(command.split())


# The commands `make demo` printed: indented lines of its ready message.
printed, current = [], None
for line in open(log, encoding="utf-8", errors="replace"):
    m = re.match(r"^\[demo\]   (.*)$", line.rstrip("\n"))
    text = m.group(1) if m else None
    if current is not None:
        current += "\n" + (text or "")
        if text is None or not text.rstrip().endswith("\\"):
            printed.append(current)
            current = None
        continue
    if text and "examples/ledger/ledger.py" in text:
        if text.rstrip().endswith("\\"):
            current = text
        else:
            printed.append(text)
if len(printed) != 3:
    problems.append(f"`make demo` printed {len(printed)} ledger.py commands, not 3: {printed}")

ran = outputs[page]
commands = [normal(c) for c, _ in ran]
for command in printed:
    if normal(command) not in commands:
        problems.append(f"`make demo` prints a command {page} does not run: {normal(command)!r}")


def answers(command):
    """The answers to each run of `command` in the walkthrough, in order."""
    return [out for c, out in ran if normal(c) == normal(command)]


def field(out, name):
    return [l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith(name + ":")]


if len(printed) == 3:
    transfer, reuse, executions = printed
    key = re.search(r"--key (\S+)", normal(transfer)).group(1)
    first = answers(transfer)
    if len(first) != 2:
        problems.append(f"the walkthrough runs the transfer {len(first)} times, not twice (the call and its retry)")
    else:
        call, retry = first
        if field(call, "status") != ["OK (0)"] or "idempotent-replayed" in call:
            problems.append(f"the first transfer is not an executed OK call: {call!r}")
        if field(retry, "status") != ["OK (0)"] or "idempotent-replayed: true" not in retry:
            problems.append(f"the retry is not a replay (OK with idempotent-replayed: true): {retry!r}")
        if not field(call, "message") or field(retry, "message") != field(call, "message"):
            problems.append(f"the replay's message differs: {field(call, 'message')} then {field(retry, 'message')}")
    if f"--key {key} " not in normal(reuse) + " " or normal(reuse) == normal(transfer):
        problems.append(f"`make demo`'s second command is not another request under {key}: {normal(reuse)!r}")
    refused = answers(reuse)
    if len(refused) != 1 or not refused[0].startswith("status:   FAILED_PRECONDITION (9)") \
            or "reason KEY_REUSED, domain idemgate.dev" not in refused[0]:
        problems.append(f"the same key with another body is not FAILED_PRECONDITION with KEY_REUSED: {refused!r}")
    counted = answers(executions)
    if f"--executions {key}" not in normal(executions) or len(counted) != 1 \
            or counted[0].strip() != f"the ledger executed '{key}' 1 time":
        problems.append(f"the ledger did not execute the key exactly once: {counted!r}")

for p in problems:
    print(f"FAIL {p}")
if problems:
    sys.exit("the gRPC step does not do what `make demo` says")
print("ok   the gRPC step: one execution, a replay with idempotent-replayed: true, KEY_REUSED for another body")
PY

say "checking that Envoy reached the store through its Unix socket"
clusters=$(curl -fsS --max-time 5 "http://127.0.0.1:$admin/clusters") || fail "Envoy's /clusters did not answer"
for cluster in idempotency_store idempotency_store_replay; do
    grep -Eq "^$cluster::\.demo/store\.sock::rq_success::[1-9]" <<<"$clusters" ||
        fail "$cluster: no call answered through .demo/store.sock: $(grep "^$cluster::.*::rq_success" <<<"$clusters")"
done
echo "ok   both store clusters were answered through .demo/store.sock"

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
for port in "${ports[@]}"; do
    port_open "$port" && fail "port $port is still open"
done
grep -q '^\[demo\] stopped' "$LOG" || fail "the demo did not report that it stopped"
say "ok: walkthroughs as documented (HTTP and gRPC); after SIGINT nothing is left running and ports ${ports[*]} are free"
