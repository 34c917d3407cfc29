. "$SAMPLES/mailer_setup.sh"
run <<'CMD'
pgbus dead list
CMD
run <<'CMD'
pgbus dead list --json
CMD
run <<'CMD'
pgbus dead retry --all --subscription mailer
CMD
