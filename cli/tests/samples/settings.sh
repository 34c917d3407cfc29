pgbus migrate >/dev/null
background shipping.log pgbus consume -s shipping -p 'order.*' --ordered
await 'consuming "shipping"' shipping.log
stop "$bg"
for order in 42 43 44; do
    pgbus publish order.placed "{\"order_id\": $order}" --aggregate "order:$order" >/dev/null
done
run <<'CMD'
pgbus consume -s shipping --unordered
CMD
run <<'CMD'
pgbus subscriptions set shipping --unordered
CMD
run <<'CMD'
pgbus subscriptions set shipping --ordered --on-dead skip
CMD
