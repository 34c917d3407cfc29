pgbus migrate >/dev/null
run <<'CMD'
pgbus consume -s mailer -p order.placed --max-attempts 3 --retry-base 100ms \
    --exec 'cat > /dev/null; echo "smtp: connection refused" >&2; exit 1' &
CMD
consumer=$!
await 'consuming "mailer"'
pgbus publish order.placed '{"order_id": 45}' --id order-45-placed >/dev/null
await 'dead-lettered'
interrupt "$consumer"
