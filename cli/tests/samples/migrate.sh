psql -q "$DATABASE_URL" -c "drop schema pgbus cascade" >/dev/null 2>&1
run <<'CMD'
pgbus migrate
CMD
run <<'CMD'
pgbus migrate
CMD
