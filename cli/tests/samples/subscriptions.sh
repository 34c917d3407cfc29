. "$SAMPLES/mailer_setup.sh"
pgbus replay --subscription mailer --since 1h >/dev/null
background audit.log pgbus consume -s audit -p 'order.*'
audit=$bg
await 'consuming "audit"' audit.log
run <<'CMD'
pgbus subscriptions list
CMD
run <<'CMD'
pgbus subscriptions drop mailer
CMD
stop "$audit"
