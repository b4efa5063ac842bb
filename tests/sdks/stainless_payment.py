"""One POST through a Stainless-generated client (`increase`, from PyPI), made
the way an application makes it: a 1 s timeout, up to 4 retries, and the
client's own Idempotency-Key, which Stainless clients send on every POST and
reuse on each retry. Run by tests/tests/sdks.rs against the demo's bootstrap.

    IDEMGATE_URL=http://127.0.0.1:10000 IDEMGATE_TOKEN=<demo JWT> \\
        python stainless_payment.py PATH DELAY_MS BODY_JSON

Prints one JSON object: `outcome` ("answered", or the SDK's exception class,
e.g. "ConflictError"), `status`, `headers`, `body` (the final answer's), and
`attempts`, one per request the client sent: its Idempotency-Key and the
status it got (null: the client timed out).
"""

import json
import os
import sys

import increase

url, token = os.environ["IDEMGATE_URL"], os.environ["IDEMGATE_TOKEN"]
path, delay_ms, body = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

attempts = []


def sent(request):
    attempts.append({"key": request.headers.get("idempotency-key"), "status": None})


def answered(response):
    attempts[-1]["status"] = response.status_code


client = increase.Increase(
    api_key=token,
    base_url=url,
    timeout=1.0,
    max_retries=4,
    http_client=increase.DefaultHttpxClient(event_hooks={"request": [sent], "response": [answered]}),
)

try:
    # The generic call every Stainless client has; cast to the raw response
    # (what `with_raw_response` returns) to see the headers too.
    raw = client.post(
        path,
        cast_to=increase.APIResponse[object],
        body=body,
        options={"headers": {"x-demo-delay-ms": delay_ms}},
    )
    result = {
        "outcome": "answered",
        "status": raw.status_code,
        "headers": dict(raw.headers),
        "body": raw.parse(),
        "retries_taken": raw.retries_taken,
    }
except increase.APIStatusError as e:
    result = {
        "outcome": type(e).__name__,
        "status": e.status_code,
        "headers": dict(e.response.headers),
        "body": e.body,
    }
except increase.APIError as e:
    result = {"outcome": type(e).__name__, "message": str(e)}

result["attempts"] = attempts
print(json.dumps(result))
