pgbus migrate >/dev/null
run <<'CMD'
pgbus consume -s tracer -p 'order.*' --exec 'cat > /dev/null; echo "$TRACEPARENT"' &
CMD
await 'consuming "tracer"'
run <<'CMD'
TRACEPARENT=00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 pgbus publish order.placed '{}'
CMD
await '^00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01$'
run <<'CMD'
kill %1
CMD
{ wait; } 2>/dev/null
