run <<'CMD'
pgbus demo --seconds 2
CMD
