-- wrk script for make bench: POSTs a small JSON payment with the identity
-- headers the bench policy reads, and an Idempotency-Key chosen by mode.
--
--   wrk ... -s bench/lua/post.lua URL -- MODE PREFIX [POOL]
--   MODE unique  a new key on every request: PREFIX-<thread>-<n>
--   MODE pool    keys PREFIX-<n mod POOL>: after one pass, every request is a
--                retry of a completed key (the replay path)
--   MODE none    no Idempotency-Key header
-- done() prints one JSON line with throughput, latency percentiles (µs) and errors.

local threads = {}
local counter = 0
id = 0 -- set per thread by setup()

function setup(thread)
    thread:set("id", #threads)
    table.insert(threads, thread)
end

function init(args)
    mode = args[1] or "unique"
    prefix = args[2] or "k"
    pool = tonumber(args[3] or "1000")
    body = '{"amount":1000,"currency":"EUR","note":"bench"}'
    base = {
        ["content-type"] = "application/json",
        ["x-tenant-id"] = "bench",
        ["x-user-id"] = "bench",
    }
end

function request()
    counter = counter + 1
    if mode == "unique" then
        base["idempotency-key"] = prefix .. "-" .. id .. "-" .. counter
    elseif mode == "pool" then
        base["idempotency-key"] = prefix .. "-" .. (counter % pool)
    end
    return wrk.format("POST", nil, base, body)
end

function done(summary, latency, requests)
    local e = summary.errors
    io.write(string.format(
        '{"requests":%d,"seconds":%.3f,"rps":%.1f,"p50_us":%d,"p99_us":%d,"p999_us":%d,' ..
        '"mean_us":%.1f,"max_us":%d,"err_connect":%d,"err_read":%d,"err_write":%d,"err_status":%d,"err_timeout":%d}\n',
        summary.requests, summary.duration / 1e6, summary.requests / (summary.duration / 1e6),
        latency:percentile(50), latency:percentile(99), latency:percentile(99.9),
        latency.mean, latency.max, e.connect, e.read, e.write, e.status, e.timeout))
end
