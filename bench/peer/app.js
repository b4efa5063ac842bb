// The upstream handler of `make bench`, in one of three stacks:
//
//   BENCH_MODE=plain  Express with the handler alone. Behind Envoy this is the
//                     upstream of every idemgate scenario; called directly it is
//                     the peer's own baseline.
//   BENCH_MODE=peer   the same Express app and handler behind express-idempotency
//                     with its Redis adapter (REDIS_URL): what a team adds to an
//                     application today.
//   BENCH_MODE=pgpeer the same app and handler behind the idempotency a
//                     PostgreSQL shop writes in the application instead (the
//                     design of Stripe's idempotency keys): a row per key in an
//                     `idempotency_keys` table (DATABASE_URL), claimed by
//                     INSERT ... ON CONFLICT DO NOTHING and committed durably
//                     (synchronous_commit on) before the handler runs; a key
//                     whose response is saved replays it, one still in
//                     progress answers 409, one sent again with other
//                     parameters 422; else the handler runs, and its response
//                     is saved (UPDATE, committed) before it is sent.
//
// POST <any path> creates a "payment" from the JSON body and answers 201 (with
// x-bench-response-bytes: N, a body of N bytes: the JSON padded at random). A path
// containing /slow takes 200 ms and counts its executions per Idempotency-Key;
// GET /_bench/executions?key=K returns that count (the duplicate-execution probe).
'use strict';

const express = require('express');

const mode = process.env.BENCH_MODE || 'plain';
const port = Number(process.env.PORT || 8080);

const app = express();
app.disable('x-powered-by');
app.disable('etag');
app.use(express.json({ limit: '4mb' }));

let created = 0;
// The padding of an answer asked to be larger (x-bench-response-bytes):
// random, so that a stored copy does not compress to nothing.
let padding = '';
function pad(n) {
    if (padding.length < n) padding = require('crypto').randomBytes(Math.ceil(n * 0.75) + 3).toString('base64');
    return padding.slice(0, n);
}
const executions = new Map();

function handler(req, res) {
    const finish = () => {
        created += 1;
        const id = `pay_${process.pid}_${created}`;
        const payment = { id, amount: req.body && req.body.amount, currency: req.body && req.body.currency, status: 'succeeded' };
        const size = Number(req.get('x-bench-response-bytes') || 0);
        if (size > 0) payment.pad = pad(Math.max(size - JSON.stringify(payment).length - 9, 0));
        res.status(201).set('x-payment-id', id).json(payment);
    };
    if (req.path.includes('/slow')) {
        const key = req.get('idempotency-key') || '';
        executions.set(key, (executions.get(key) || 0) + 1);
        setTimeout(finish, 200);
    } else {
        finish();
    }
}

app.get('/_bench/executions', (req, res) => {
    res.json({ key: req.query.key, executions: executions.get(String(req.query.key)) || 0 });
});
app.get('/_bench/ready', (_req, res) => res.json({ mode }));

// The table of BENCH_MODE=pgpeer. No recovery of a key whose handler failed
// (a production version adds a reaper or recovery points): the bench's
// handler does not fail.
const PG_SCHEMA = `CREATE TABLE IF NOT EXISTS idempotency_keys (
    user_id          text        NOT NULL,
    idempotency_key  text        NOT NULL CHECK (length(idempotency_key) <= 255),
    request_method   text        NOT NULL,
    request_path     text        NOT NULL,
    request_params   jsonb       NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    response_code    integer,
    response_headers jsonb,
    response_body    text,
    PRIMARY KEY (user_id, idempotency_key)
)`;

async function pgIdempotency(url) {
    const { Pool } = require('pg');
    const pool = new Pool({
        connectionString: url,
        max: Number(process.env.PG_POOL_SIZE || 10),
        // The claim must be on disk before the handler runs.
        options: '-c synchronous_commit=on',
    });
    await pool.query(PG_SCHEMA);
    const claim = `INSERT INTO idempotency_keys (user_id, idempotency_key, request_method, request_path, request_params)
                   VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING`;
    const lookup = `SELECT request_method = $3 AND request_path = $4 AND request_params = $5::jsonb AS same,
                           response_code, response_headers, response_body
                    FROM idempotency_keys WHERE user_id = $1 AND idempotency_key = $2`;
    const save = `UPDATE idempotency_keys SET response_code = $3, response_headers = $4, response_body = $5
                  WHERE user_id = $1 AND idempotency_key = $2`;
    return (req, res, next) => {
        const key = req.get('idempotency-key');
        if (!key) return next();
        const args = [req.get('x-user-id') || '', key, req.method, req.path, JSON.stringify(req.body ?? {})];
        pool.query(claim, args).then(async (claimed) => {
            if (claimed.rowCount === 1) {
                // Owned: the response is saved before it goes out.
                const send = res.json.bind(res);
                res.json = (body) => {
                    const headers = {};
                    for (const [name, value] of Object.entries(res.getHeaders())) {
                        if (name.startsWith('x-')) headers[name] = value;
                    }
                    pool.query(save, [args[0], key, res.statusCode, JSON.stringify(headers), JSON.stringify(body)])
                        .then(() => send(body), (e) => {
                            res.status(500);
                            send({ error: `saving the response: ${e.message}` });
                        });
                    return res;
                };
                return next();
            }
            const { rows } = await pool.query(lookup, args);
            const row = rows[0];
            if (!row) return res.status(409).json({ error: 'the key was released; retry' });
            if (!row.same) return res.status(422).json({ error: 'this key was used with other parameters' });
            if (row.response_code === null) return res.status(409).json({ error: 'a request with this key is in progress' });
            // The body as it was sent (jsonb would reorder its keys).
            return res.status(row.response_code).set(row.response_headers || {}).set('idempotent-replayed', 'true')
                .type('application/json').send(row.response_body);
        }).catch(next);
    };
}

async function main() {
    if (mode === 'peer') {
        const idempotency = require('express-idempotency');
        const RedisAdapter = require('express-idempotency-redis-adapter').default;
        const adapter = new RedisAdapter({ connectionConfig: { url: process.env.REDIS_URL || 'redis://127.0.0.1:6379' } });
        await adapter.connect();
        app.post('*', idempotency.idempotency({ dataAdapter: adapter }));
        const service = idempotency.getSharedIdempotencyService();
        // As the middleware's README says: a hit was answered by the middleware.
        app.post('*', (req, res) => {
            if (service.isHit(req)) return;
            handler(req, res);
        });
    } else if (mode === 'pgpeer') {
        app.post('*', await pgIdempotency(process.env.DATABASE_URL || 'postgres://127.0.0.1:5432/postgres'), handler);
    } else if (mode === 'plain') {
        app.post('*', handler);
    } else {
        throw new Error(`BENCH_MODE must be plain, peer or pgpeer, not ${mode}`);
    }
    // The middleware answers "in progress" and "misuse" by next(err) with the
    // status already set; answer those without Express's stack-trace logging.
    // eslint-disable-next-line no-unused-vars
    app.use((err, _req, res, _next) => {
        if (!res.headersSent) res.status(res.statusCode >= 400 ? res.statusCode : 500).json({ error: err.message });
    });
    const server = app.listen(port, '127.0.0.1', () => console.log(`bench app (${mode}) on 127.0.0.1:${port}`));
    // Longer than Envoy's idle timeout, so pooled upstream connections are not
    // closed under Envoy's feet.
    server.keepAliveTimeout = 120_000;
    server.headersTimeout = 121_000;
    process.on('SIGTERM', () => process.exit(0));
}

main().catch((e) => {
    console.error(e);
    process.exit(1);
});
