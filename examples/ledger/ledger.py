"""A real gRPC ledger and its client, from PyPI's grpcio: the gRPC service of
`make demo` and of the gRPC tests (tests/tests/grpc.rs).

  ledger.py serve PORT          a gRPC server with ledger.v1.Ledger/Transfer,
                                which counts its executions per idempotency
                                key, and ledger.v1.Ledger/Executions, which
                                reports that count (never covered by a policy)
      --compress gzip           compress every answer (`grpc-encoding: gzip`)
  ledger.py call TARGET ...     one or more Transfer calls; prints a JSON line
                                per call: what the client read (status,
                                message, metadata, error details)
      --token JWT               also send `authorization: Bearer JWT` (the
                                demo's identity; `make demo`)
      --pretty                  print each answer for a human instead of JSON
                                (without the per-hop headers date, server,
                                content-length, x-envoy-upstream-service-time)

Messages are raw bytes: the filter never reads them, so no schema is needed.
A Transfer's request says what the handler does: `sleep=MS` waits first,
`code=N` ends with that status after acting (N=0: a message), `refuse=N`
ends with status N without acting, `control=V` adds `idempotency-control: V`
to the trailing metadata.
"""

import argparse
import base64
import json
import sys
import threading
import time
from concurrent import futures

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

SERVICE = "ledger.v1.Ledger"


class Ledger:
    def __init__(self):
        self.lock = threading.Lock()
        self.executions = {}

    def transfer(self, request, context):
        meta = dict(context.invocation_metadata())
        key = meta.get("idempotency-key", "")
        words = dict(w.split("=", 1) for w in request.decode().split(";") if "=" in w)
        control = [("idempotency-control", words["control"])] if "control" in words else []
        if "refuse" in words:
            context.set_trailing_metadata(tuple(control))
            context.abort(grpc.StatusCode(_code(int(words["refuse"]))), "refused before acting")
        with self.lock:
            n = self.executions.get(key, 0) + 1
            self.executions[key] = n
        time.sleep(int(words.get("sleep", "0")) / 1000)
        context.send_initial_metadata((("x-ledger-entry", f"entry-{n}"), ("x-unlisted", "u")))
        context.set_trailing_metadata((("x-ledger-trailer", f"trailer-{n}"), *control))
        code = int(words.get("code", "0"))
        if code:
            context.abort(grpc.StatusCode(_code(code)), f"acted, then failed: {n}")
        return b"executed " + str(n).encode() + b" for " + request

    def count(self, request, context):
        with self.lock:
            return str(self.executions.get(request.decode(), 0)).encode()


def _code(n):
    return next(c for c in grpc.StatusCode if c.value[0] == n)


def serve(port, compress=None):
    ledger = Ledger()
    handlers = {
        "Transfer": grpc.unary_unary_rpc_method_handler(ledger.transfer),
        "Executions": grpc.unary_unary_rpc_method_handler(ledger.count),
    }
    compression = grpc.Compression.Gzip if compress == "gzip" else None
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), compression=compression)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("listening", flush=True)
    server.wait_for_termination()


def details(call):
    """The filter's google.rpc.Status details, as a client library reads them."""
    status = rpc_status.from_call(call)
    if status is None:
        return None
    out = {}
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            out["reason"], out["domain"] = info.reason, info.domain
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            out["retry_ms"] = retry.retry_delay.seconds * 1000 + retry.retry_delay.nanos // 1_000_000
    return out


def one_call(channel, args, body):
    transfer = channel.unary_unary(f"/{SERVICE}/Transfer")
    metadata = [("x-tenant-id", args.tenant)] + _auth(args)
    if args.key is not None:
        metadata.append(("idempotency-key", args.key))
    try:
        message, call = transfer.with_call(body.encode(), timeout=args.timeout, metadata=metadata)
        error = None
    except grpc.RpcError as e:
        message, call, error = None, e, e
    return {
        "code": call.code().value[0],
        "details": call.details(),
        "message": None if message is None else base64.b64encode(message).decode(),
        "text": None if message is None else message.decode(errors="replace"),
        "initial": [[k, v if isinstance(v, str) else base64.b64encode(v).decode()] for k, v in (call.initial_metadata() or [])],
        "trailing": [[k, v if isinstance(v, str) else base64.b64encode(v).decode()] for k, v in (call.trailing_metadata() or [])],
        "error": details(error) if error is not None and call.code() != grpc.StatusCode.DEADLINE_EXCEEDED else None,
    }


def _auth(args):
    return [("authorization", f"Bearer {args.token}")] if args.token else []


def _status_name(code):
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))


# Added by each hop, different on every call: left out of --pretty's output.
PER_HOP = {"date", "server", "content-length", "x-envoy-upstream-service-time"}


def pretty(result):
    """One answer as a person reads it: the status, the message, the
    metadata (`idempotent-replayed` among it on a replay) and the filter's
    error details."""
    lines = [f"status:   {_status_name(result['code'])} ({result['code']})"]
    if result["details"]:
        lines[0] += f": {result['details']}"
    if result["text"] is not None:
        lines.append(f"message:  {result['text']}")
    for part in ("initial", "trailing"):
        label = "headers:" if part == "initial" else "trailers:"
        for name, value in result[part]:
            if name in PER_HOP:
                continue
            if name == "grpc-status-details-bin":
                value = "(google.rpc.Status, read below)"
            lines.append(f"{label:<9} {name}: {value}")
            label = ""
    if result["error"]:
        lines.append("error:    " + ", ".join(f"{k} {v}" for k, v in result["error"].items()))
    return "\n".join(lines)


def call(args):
    with grpc.insecure_channel(args.target) as channel:
        if args.executions is not None:
            count = channel.unary_unary(f"/{SERVICE}/Executions")
            n = int(count(args.executions.encode(), timeout=5, metadata=_auth(args)))
            if args.pretty:
                print(f"the ledger executed {args.executions!r} {n} time{'' if n == 1 else 's'}")
            else:
                print(json.dumps({"executions": n}))
            return
        with futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
            results = list(pool.map(lambda _: one_call(channel, args, args.body), range(args.parallel)))
        if args.pretty:
            print("\n\n".join(map(pretty, results)), flush=True)
            return
        for result in results:
            print(json.dumps(result), flush=True)


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("port", type=int)
    s.add_argument("--compress", choices=["gzip"], help="compress every answer with this encoding")
    c = sub.add_parser("call")
    c.add_argument("target")
    c.add_argument("--key")
    c.add_argument("--tenant", default="acme")
    c.add_argument("--body", default="amount=100")
    c.add_argument("--timeout", type=float, default=10.0)
    c.add_argument("--parallel", type=int, default=1)
    c.add_argument("--executions", help="print how often the upstream ran this key")
    c.add_argument("--token", help="send `authorization: Bearer TOKEN` (a JWT, as the demo's Envoy asks)")
    c.add_argument("--pretty", action="store_true", help="print each answer for a human, not as JSON")
    args = parser.parse_args()
    if args.command == "serve":
        serve(args.port, args.compress)
    else:
        call(args)


if __name__ == "__main__":
    sys.exit(main())
