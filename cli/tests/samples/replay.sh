. "$SAMPLES/mailer_setup.sh"
run <<'CMD'
pgbus replay --subscription mailer --since 1h
CMD
