run <<'CMD'
pgbus migrate
CMD
run <<'CMD'
pgbus migrate
CMD
