-- wrk script for make bench: POSTs a small JSON payment with the identity
-- headers the bench policy reads, and an Idempotency-Key chosen by mode.
--
--   wrk ... -s bench/lua/post.lua URL -- MODE PREFIX [POOL]
--   MODE unique  a new key on every request: PREFIX-<thread>-<n>
--   MODE pool    keys PREFIX-<n mod POOL>: after one pass, every request is a
--                retry of a completed key (the replay path)
--   MODE random  a new key on every request, UUID-shaped and led by 12 random
--                hex digits, so keys land all over the store's indexes (as
--                clients' UUIDs do): RRRRRRRR-RRRR-4RRR-aRRR-<PREFIX>-<thread>-<n>
--   MODE spool   like pool, but keys spread over the key space as random ones
--                are: HHHHHHHH-<PREFIX>-<n mod POOL>
--   MODE none    no Idempotency-Key header
-- With BENCH_BODY_BYTES=N in the environment, the body is N bytes (the JSON
-- padded with random characters) and asks the bench's upstream for a response body of N bytes
-- (x-bench-response-bytes).
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
    -- Every wrk run has its own prefix; the seed only spreads the keys (the
    -- counter keeps them unique).
    local seed = os.time()
    for i = 1, #prefix do seed = (seed * 31 + prefix:byte(i)) % 2147483647 end
    math.randomseed(seed + id)
    body = '{"amount":1000,"currency":"EUR","note":"bench"}'
    base = {
        ["content-type"] = "application/json",
        ["x-tenant-id"] = "bench",
        ["x-user-id"] = "bench",
    }
    local size = tonumber(os.getenv("BENCH_BODY_BYTES") or "")
    if size then
        -- Random letters and digits: a repeated character would compress to
        -- nothing wherever a body is stored.
        local head, chars, pad = '{"amount":1000,"currency":"EUR","note":"', "abcdefghijklmnopqrstuvwxyz0123456789", {}
        for i = 1, math.max(size - #head - 2, 0) do
            local r = math.random(1, #chars)
            pad[i] = chars:sub(r, r)
        end
        body = head .. table.concat(pad) .. '"}'
        base["x-bench-response-bytes"] = tostring(size)
    end
end

function request()
    counter = counter + 1
    if mode == "unique" then
        base["idempotency-key"] = prefix .. "-" .. id .. "-" .. counter
    elseif mode == "pool" then
        base["idempotency-key"] = prefix .. "-" .. (counter % pool)
    elseif mode == "random" then
        base["idempotency-key"] = string.format("%04x%04x-%04x-4%03x-a%03x-", math.random(0, 65535),
            math.random(0, 65535), math.random(0, 65535), math.random(0, 4095), math.random(0, 4095)) .. prefix .. "-" .. id .. "-" .. counter
    elseif mode == "spool" then
        local n = counter % pool
        base["idempotency-key"] = string.format("%08x-", (n * 2654435761) % 4294967296) .. prefix .. "-" .. n
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
