// The callout microbenchmark's trivial server: every request gets 200 and
// "ok" on a kept-alive connection; nothing else (SINK_PORT).
'use strict';
const http = require('http');
const server = http.createServer((req, res) => {
    req.resume();
    req.on('end', () => {
        res.writeHead(200, { 'content-type': 'text/plain', 'content-length': '2' });
        res.end('ok');
    });
});
server.keepAliveTimeout = 120_000;
server.headersTimeout = 121_000;
server.listen(Number(process.env.SINK_PORT || 8081), '127.0.0.1');
process.on('SIGTERM', () => process.exit(0));
