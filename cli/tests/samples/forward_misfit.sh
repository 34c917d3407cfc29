pgbus migrate >/dev/null
start_nats
# A stream "PGBUS" for the subjects pgbus.>, as a first forwarder creates it.
background forward.log pgbus forward -s x -p '*'
await 'forwarding "x"' forward.log
stop "$bg"
run <<'CMD'
pgbus forward -s x -p '*' --subject-prefix app
CMD
stop "$nats"
