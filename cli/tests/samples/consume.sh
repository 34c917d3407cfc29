pgbus migrate >/dev/null
run <<'CMD'
pgbus consume --subscription audit --pattern 'order.*' &
CMD
consumer=$!
await 'consuming "audit"'
pgbus publish order.placed '{"order_id": 42}' --aggregate order:42 --correlation-id req-7f3a >/dev/null
printf '{"order_id": 43}\n{"order_id": 44}\n' | pgbus publish order.imported - --lines >/dev/null
await '"order_id":44'
interrupt "$consumer"
