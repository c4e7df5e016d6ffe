-- wrk script: POST real request bodies in turn and count every status.
--   WRK_BODIES=runs/bench/inputs/classify.jsonl wrk -t1 -c8 -d10s -s bench/loadgen/replay.lua URL
-- WRK_BODIES is a file of JSON bodies, one per line. Each connection starts at its own offset so
-- concurrent connections do not send the same sentence at the same moment. The summary is one
-- line of JSON after the marker "WRK_JSON " on stdout (latencies in microseconds).

local threads = {}

function setup(thread)
   table.insert(threads, thread)
end

function init(args)
   bodies = {}
   for line in io.lines(os.getenv("WRK_BODIES")) do
      if #line > 0 then bodies[#bodies + 1] = line end
   end
   statuses = {}
   counter = (#threads * 7919) % #bodies + 1
   wrk.method = "POST"
   wrk.headers["Content-Type"] = "application/json"
end

function request()
   local body = bodies[counter]
   counter = counter % #bodies + 1
   return wrk.format(nil, nil, nil, body)
end

function response(status, headers, body)
   statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
   local totals, codes = {}, {}
   for _, thread in ipairs(threads) do
      for status, count in pairs(thread:get("statuses")) do
         totals[status] = (totals[status] or 0) + count
      end
   end
   for status, count in pairs(totals) do
      codes[#codes + 1] = string.format('"%d": %d', status, count)
   end
   local e = summary.errors
   io.write(string.format(
      'WRK_JSON {"requests": %d, "duration_us": %d, "bytes": %d, ' ..
      '"errors": {"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}, ' ..
      '"statuses": {%s}, "latency_us": {"mean": %.1f, "p50": %d, "p90": %d, "p95": %d, ' ..
      '"p99": %d, "max": %d}}\n',
      summary.requests, summary.duration, summary.bytes,
      e.connect, e.read, e.write, e.status, e.timeout, table.concat(codes, ", "),
      latency.mean, latency:percentile(50), latency:percentile(90), latency:percentile(95),
      latency:percentile(99), latency.max))
end
