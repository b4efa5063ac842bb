#!/usr/bin/env python3
"""Checks that a live route enforces the Idempotency-Key contract.

  scripts/rollout-check.py URL [-H 'name: value']... [--body JSON] [--other-body JSON]

Run it after each rollout step against a route a policy covers, as a test
identity (the headers or bearer token the route reads its tenant from). It
sends only to URL, only with the headers given, and at most 7 requests, each
with a fresh key of its own (`rollout-check-...`): every check that executes
the upstream does it with the test identity's request, at most 3 times in
all. It prints a verdict per check and exits 1 if any failed:

  new-key       a new key is forwarded and answered by the upstream
  replay        its retry replays the answer (Idempotent-Replayed: true)
  key-reused    the key with another body gets 422 key-reused
  concurrent    a duplicate sent while the first is in flight gets 409
                request-in-progress, or waits and replays; never runs twice
  key-missing   a request without a key gets 400 key-missing (skipped with
                --optional-key, for policies with require_key: false)

Python's standard library only, so it runs wherever Python 3 does.
"""

import argparse
import json
import secrets
import sys
import threading
import urllib.error
import urllib.request


def send(args, key, body):
    headers = {"content-type": "application/json"}
    for h in args.header:
        name, _, value = h.partition(":")
        headers[name.strip()] = value.strip()
    if key is not None:
        headers["idempotency-key"] = f'"{key}"'
    request = urllib.request.Request(args.url, data=body.encode(), headers=headers, method=args.method)
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as r:
            return r.status, dict(r.headers.items()), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers.items()), e.read()


def header(answer, name):
    return next((v for k, v in answer[1].items() if k.lower() == name), None)


def problem(answer):
    if not (header(answer, "content-type") or "").startswith("application/problem+json"):
        return None
    try:
        return json.loads(answer[2]).get("type", "").rsplit("/", 1)[-1]
    except ValueError:
        return None


def show(answer):
    kind = problem(answer)
    replayed = header(answer, "idempotent-replayed")
    return f"{answer[0]}" + (f" {kind}" if kind else "") + (" replayed" if replayed else "")


def check_new_key_and_replay(args, verdicts):
    key = f"rollout-check-{secrets.token_hex(8)}"
    first = send(args, key, args.body)
    new_ok = problem(first) is None and header(first, "idempotent-replayed") is None and first[0] < 500
    verdicts.append(("new-key", new_ok, f"first request: {show(first)}"))
    retry = send(args, key, args.body)
    replay_ok = header(retry, "idempotent-replayed") == "true" and retry[0] == first[0] and retry[2] == first[2]
    verdicts.append(("replay", replay_ok, f"retry: {show(retry)}" + ("" if replay_ok else ", expected the first answer replayed")))
    other = send(args, key, args.other_body)
    reused_ok = other[0] == 422 and problem(other) == "key-reused"
    verdicts.append(("key-reused", reused_ok, f"another body: {show(other)}"))


def check_concurrent(args, verdicts):
    key = f"rollout-check-{secrets.token_hex(8)}"
    answers = [None, None]

    def one(i):
        answers[i] = send(args, key, args.body)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kinds = sorted(
        "in-progress" if problem(a) == "request-in-progress"
        else "replayed" if header(a, "idempotent-replayed") == "true"
        else "executed" if problem(a) is None
        else f"other({show(a)})"
        for a in answers
    )
    ok = kinds in (["executed", "in-progress"], ["executed", "replayed"])
    verdicts.append(("concurrent", ok, "two at once: " + ", ".join(kinds) + ("" if ok else "; expected one executed and one 409 or replay")))


def check_key_missing(args, verdicts):
    if args.optional_key:
        verdicts.append(("key-missing", None, "skipped (--optional-key)"))
        return
    answer = send(args, None, args.body)
    ok = answer[0] == 400 and problem(answer) == "key-missing"
    verdicts.append(("key-missing", ok, f"no key: {show(answer)}"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url")
    parser.add_argument("-H", "--header", action="append", default=[], help="'name: value', e.g. the test tenant's identity")
    parser.add_argument("--method", default="POST")
    parser.add_argument("--body", default='{"amount": 1, "currency": "usd", "rollout_check": true}')
    parser.add_argument("--other-body", default='{"amount": 2, "currency": "usd", "rollout_check": true}')
    parser.add_argument("--optional-key", action="store_true")
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    verdicts = []
    try:
        check_new_key_and_replay(args, verdicts)
        check_concurrent(args, verdicts)
        check_key_missing(args, verdicts)
    except (urllib.error.URLError, OSError) as e:
        print(f"FAIL  reach       {args.url}: {e}")
        return 1
    for name, ok, detail in verdicts:
        mark = "SKIP" if ok is None else "PASS" if ok else "FAIL"
        print(f"{mark}  {name:<11} {detail}")
    failed = [name for name, ok, _ in verdicts if ok is False]
    print("verdict: " + ("the route enforces the contract" if not failed else "NOT enforced: " + ", ".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
