pgbus migrate >/dev/null
run <<'CMD'
pgbus sweep --retention 7d
CMD
