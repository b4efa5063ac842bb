// The upstream handler of `make bench`, in one of two stacks:
//
//   BENCH_MODE=plain  Express with the handler alone. Behind Envoy this is the
//                     upstream of every idemgate scenario; called directly it is
//                     the peer's own baseline.
//   BENCH_MODE=peer   the same Express app and handler behind express-idempotency
//                     with its Redis adapter (REDIS_URL): what a team adds to an
//                     application today.
//
// POST <any path> creates a "payment" from the JSON body and answers 201. A path
// containing /slow takes 200 ms and counts its executions per Idempotency-Key;
// GET /_bench/executions?key=K returns that count (the duplicate-execution probe).
'use strict';

const express = require('express');

const mode = process.env.BENCH_MODE || 'plain';
const port = Number(process.env.PORT || 8080);

const app = express();
app.disable('x-powered-by');
app.disable('etag');
app.use(express.json({ limit: '1mb' }));

let created = 0;
const executions = new Map();

function handler(req, res) {
    const finish = () => {
        created += 1;
        const id = `pay_${process.pid}_${created}`;
        res.status(201)
            .set('x-payment-id', id)
            .json({ id, amount: req.body && req.body.amount, currency: req.body && req.body.currency, status: 'succeeded' });
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
    } else if (mode === 'plain') {
        app.post('*', handler);
    } else {
        throw new Error(`BENCH_MODE must be plain or peer, not ${mode}`);
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
