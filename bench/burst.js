// Duplicate-execution probe: N identical requests with one Idempotency-Key,
// all in flight at once, to a handler that takes 200 ms; then asks the
// upstream how many times it executed for that key. A race's count varies
// from one try to the next, so the burst is repeated ROUNDS times (a key
// each, one round after the other).
//
//   node bench/burst.js URL KEY N EXECUTIONS_URL [ROUNDS]
// Prints one JSON line: {"sent":N,"statuses":{...},"per_round":[...]}: the
// statuses of every round, and each round's executions.
'use strict';
const http = require('http');

const [url, key, n, execUrl, r] = process.argv.slice(2);
const count = Number(n || 50);
const rounds = Number(r || 1);
const body = JSON.stringify({ amount: 1000, currency: 'EUR', note: 'burst' });
const agent = new http.Agent({ keepAlive: false, maxSockets: Infinity });

function post(key) {
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
    const statuses = {};
    const perRound = [];
    for (let i = 1; i <= rounds; i++) {
        const k = rounds > 1 ? `${key}-${i}` : key;
        const codes = await Promise.all(Array.from({ length: count }, () => post(k)));
        for (const c of codes) statuses[c] = (statuses[c] || 0) + 1;
        perRound.push((await get(`${execUrl}?key=${encodeURIComponent(k)}`)).executions);
    }
    console.log(JSON.stringify({ sent: count, statuses, per_round: perRound }));
})().catch((e) => { console.error(e); process.exit(1); });
