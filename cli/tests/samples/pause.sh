# A running consumer of "mailer": paused, a new order waits (the status shows it pending
# under a paused subscription); resumed, the consumer is notified and handles it.
pgbus migrate >/dev/null
background mailer.log pgbus consume -s mailer -p order.placed --exec 'cat > /dev/null'
mailer=$bg
await 'consuming "mailer"' mailer.log
run <<'CMD'
pgbus subscriptions pause mailer
CMD
pgbus publish order.placed '{"order_id": 46}' >/dev/null
run <<'CMD'
pgbus subscriptions list
CMD
run <<'CMD'
pgbus subscriptions resume mailer
CMD
# Handled: the order's delivery is finished (the status's count of the last minute).
deadline=$((SECONDS + 20))
until pgbus status -s mailer --json | grep -q '"done_last_minute":1'; do
    ((SECONDS < deadline)) || { echo "sample: the resumed order was not handled" >&2; exit 1; }
    sleep 0.05
done
stop "$mailer"
grep -q 'stopped: 1 acked' mailer.log
