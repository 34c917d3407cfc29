pgbus migrate >/dev/null
run <<'CMD'
pgbus publish order.placed '{"order_id": 42}' --aggregate order:42 --correlation-id req-7f3a
CMD
run <<'CMD'
printf '{"order_id": 43}\n{"order_id": 44}\n' | pgbus publish order.imported - --lines
CMD
run <<'CMD'
pgbus publish order.placed '{"order_id": 45}' --id order-45-placed
CMD
run <<'CMD'
pgbus publish order.placed '{"order_id": "\u0000"}'
CMD
run <<'CMD'
echo $?
CMD
