// Duplicate-execution probe: N identical requests with one Idempotency-Key,
// all in flight at once, to a handler that takes 200 ms; then asks the
// upstream how many times it executed for that key.
//
//   node bench/burst.js URL KEY N EXECUTIONS_URL
// Prints one JSON line: {"sent":N,"statuses":{...},"executions":E}.
'use strict';
const http = require('http');

const [url, key, n, execUrl] = process.argv.slice(2);
const count = Number(n || 50);
const body = JSON.stringify({ amount: 1000, currency: 'EUR', note: 'burst' });
const agent = new http.Agent({ keepAlive: false, maxSockets: Infinity });

function post() {
    return new Promise((resolve) => {
        const req = http.request(url, {
            method: 'POST', agent,
            headers: {
                'content-type': 'application/json', 'content-length': Buffer.byteLength(body),
                'idempotency-key': key, 'x-tenant-id': 'bench', 'x-user-id': 'bench',
            },
        }, (res) => { res.resume(); res.on('end', () => resolve(res.statusCode)); });
        req.on('error', () => resolve('error'));
        req.end(body);
    });
}

function get(u) {
    return new Promise((resolve, reject) => {
        http.get(u, (res) => {
            let data = '';
            res.on('data', (c) => { data += c; });
            res.on('end', () => { try { resolve(JSON.parse(data)); } catch (e) { reject(e); } });
        }).on('error', reject);
    });
}

(async () => {
    const codes = await Promise.all(Array.from({ length: count }, post));
    const statuses = {};
    for (const c of codes) statuses[c] = (statuses[c] || 0) + 1;
    const ex = await get(`${execUrl}?key=${encodeURIComponent(key)}`);
    console.log(JSON.stringify({ sent: count, statuses, executions: ex.executions }));
})().catch((e) => { console.error(e); process.exit(1); });
