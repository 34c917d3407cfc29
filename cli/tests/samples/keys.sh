. "$SAMPLES/shipping_setup.sh"
run <<'CMD'
pgbus consume -s shipping -p 'order.*' --ordered --max-attempts 1 --exec ./ship.sh &
CMD
consumer=$!
await 'consuming "shipping"'
for name in order.placed order.paid order.shipped; do
    pgbus publish "$name" '{"order_id": 42}' --aggregate order:42 >/dev/null
done
await 'dead-lettered'
interrupt "$consumer"
run <<'CMD'
pgbus keys list
CMD
run <<'CMD'
pgbus status
CMD
run <<'CMD'
pgbus keys skip shipping order:42
CMD
run <<'CMD'
pgbus keys list
CMD
