# Sourced by scenarios that start from the mailer's dead letter: subscription "mailer"
# (order.placed, 3 attempts), whose command fails for order-45-placed only; order 42 is
# delivered and acknowledged, order 45 is a dead letter after 3 attempts.
pgbus migrate >/dev/null
background mailer.log pgbus consume -s mailer -p order.placed --max-attempts 3 --retry-base 100ms \
    --exec 'cat > /dev/null; [ "$PGBUS_EVENT_ID" != order-45-placed ] || { echo "smtp: connection refused" >&2; exit 1; }'
mailer=$bg
await 'consuming "mailer"' mailer.log
pgbus publish order.placed '{"order_id": 42}' >/dev/null
pgbus publish order.placed '{"order_id": 45}' --id order-45-placed >/dev/null
await 'attempt 3 failed' mailer.log
stop "$mailer"
grep -q 'stopped: 1 acked, 3 failed attempts' mailer.log
