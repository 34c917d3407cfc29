pgbus migrate >/dev/null
background waiting.log pgbus consume -s waiting -p 'job.*'
await 'consuming "waiting"' waiting.log
stop "$bg"
printf '{"job": 1}\n{"job": 2}\n{"job": 3}\n{"job": 4}\n' | pgbus publish job.queued - --lines >/dev/null
pgbus publish job.queued '{"job": 5}' --delay 1h >/dev/null
# The deliveries a running bus would have made.
psql -q "$DATABASE_URL" -c 'SELECT pgbus.fan_out_committed()' >/dev/null
port=$(free_port)
run <<CMD
pgbus metrics --listen 127.0.0.1:$port &
CMD
metrics=$!
await 'serving metrics'
# The first sample is taken as the server starts: wait until it is served.
deadline=$((SECONDS + 20))
until curl -s "http://127.0.0.1:$port/metrics" | grep -q 'state="due"} 4'; do
    ((SECONDS < deadline)) || { echo "sample: no sample served" >&2; exit 1; }
    sleep 0.05
done
run <<CMD
curl -s http://127.0.0.1:$port/metrics | grep 'subscription="waiting"' | sort
CMD
interrupt "$metrics"
