"""One payment intent through Stripe's Python SDK (`stripe`, from PyPI), made
the way an application makes it: a 1 s timeout, up to 4 network retries, and
the SDK's own Idempotency-Key, which it sends on every POST and reuses on each
retry. Run by tests/tests/sdks.rs against the demo's bootstrap, whose
`POST /v1/payment_intents` speaks Stripe's dialect (form-encoded requests,
Stripe-shaped objects; `metadata[delay_ms]` slows the upstream down).

    IDEMGATE_URL=http://127.0.0.1:10000 IDEMGATE_TOKEN=<demo JWT> \\
        python stripe_payment_intent.py AMOUNT DELAY_MS

Prints one JSON object: `outcome` ("answered", or the SDK's exception class),
`status`, `headers`, `body` (the final answer's), and `attempts`, one per
request the SDK sent: its Idempotency-Key and the status it got (null: the
request timed out).
"""

import json
import os
import sys

import stripe

url, token = os.environ["IDEMGATE_URL"], os.environ["IDEMGATE_TOKEN"]
amount, delay_ms = int(sys.argv[1]), sys.argv[2]

attempts = []


class Recording(stripe.RequestsClient):
    """Stripe's default HTTP client, noting each attempt the SDK makes."""

    def request(self, method, url, headers, post_data=None, **kwargs):
        attempt = {"key": (headers or {}).get("Idempotency-Key"), "status": None}
        attempts.append(attempt)
        content, status, response_headers = super().request(method, url, headers, post_data, **kwargs)
        attempt["status"] = status
        return content, status, response_headers


client = stripe.StripeClient(
    token,
    base_addresses={"api": url},
    max_network_retries=4,
    http_client=Recording(timeout=1),
)

try:
    intent = client.v1.payment_intents.create(
        params={"amount": amount, "currency": "eur", "metadata": {"delay_ms": delay_ms}}
    )
    response = intent.last_response
    result = {
        "outcome": "answered",
        "status": response.code,
        "headers": {k.lower(): v for k, v in response.headers.items()},
        "body": json.loads(response.body),
        "object": {"id": intent.id, "object": intent.object, "amount": intent.amount},
    }
except stripe.StripeError as e:
    result = {
        "outcome": type(e).__name__,
        "status": e.http_status,
        "headers": {k.lower(): v for k, v in (e.headers or {}).items()},
        "body": e.json_body,
        "message": str(e),
    }

result["attempts"] = attempts
print(json.dumps(result))
