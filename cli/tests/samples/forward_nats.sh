pgbus migrate >/dev/null
# `cargo run ... --example nats_tail --` as built by the tests, with its arguments.
cargo() {
    while [ "$1" != -- ]; do shift; done
    shift
    "$PGBUS_NATS_TAIL" "$@"
}
port=$(free_port)
run <<CMD
nats-server -js -a 127.0.0.1 -p $port -sd /tmp/nats-store-$port >nats.log 2>&1 &
CMD
nats=$!
await 'Server is ready' nats.log
run <<CMD
export NATS_URL=nats://127.0.0.1:$port
CMD
run <<'CMD'
pgbus forward --subscription to-nats --pattern 'order.*' --ordered &
CMD
forward=$!
await 'forwarding "to-nats"'
run <<'CMD'
pgbus publish order.placed '{"order_id": 42}' --aggregate order:42 \
    --header traceparent=00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01
CMD
run <<'CMD'
pgbus publish order.paid '{"order_id": 42}' --aggregate order:42
CMD
run <<'CMD'
pgbus publish order.placed '{"order_id": 43}' --aggregate order:43
CMD
run <<'CMD'
cargo run -q -p pgbus-cli --example nats_tail -- $NATS_URL PGBUS --count 3
CMD
run <<'CMD'
kill %2
CMD
{ wait "$forward"; } 2>/dev/null
kill "$nats"
{ wait "$nats"; } 2>/dev/null
rm -rf "/tmp/nats-store-$port"
