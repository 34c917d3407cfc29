. "$SAMPLES/shipping_setup.sh"
background audit.log pgbus consume -s audit -p 'order.*'
audit=$bg
await 'consuming "audit"' audit.log
background shipping.log pgbus consume -s shipping -p 'order.*' --ordered --max-attempts 1 --exec ./ship.sh
shipping=$bg
await 'consuming "shipping"' shipping.log
for name in order.placed order.paid order.shipped; do
    pgbus publish "$name" '{"order_id": 42}' --aggregate order:42 >/dev/null
done
await 'dead-lettered' shipping.log
await '"name":"order.shipped"' audit.log
stop "$shipping"
stop "$audit"
grep -q 'stopped: 3 acked' audit.log
grep -q 'stopped: 1 acked, 1 failed' shipping.log
run <<'CMD'
pgbus status
CMD
