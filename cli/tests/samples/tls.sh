# A TLS-only server whose certificate names `localhost`, reached by address; ca.pem is
# the certificate of the CA that signed it.
cp "$TLS_CA" ca.pem
pgbus migrate --database-url "postgres://$TLS_USER@127.0.0.1:$TLS_PORT/$TLS_DATABASE?sslmode=require" >/dev/null
run <<CMD
DATABASE_URL='postgres://$TLS_USER@127.0.0.1:$TLS_PORT/$TLS_DATABASE?sslmode=require' pgbus status
CMD
run <<CMD
DATABASE_URL='postgres://$TLS_USER@127.0.0.1:$TLS_PORT/$TLS_DATABASE?sslmode=verify-full&sslrootcert=ca.pem' pgbus status
CMD
run <<'CMD'
echo $?
CMD
unset DATABASE_URL
run <<CMD
PGHOST=127.0.0.1 PGPORT=$TLS_PORT PGUSER=$TLS_USER PGDATABASE=$TLS_DATABASE PGSSLMODE=require pgbus status
CMD
