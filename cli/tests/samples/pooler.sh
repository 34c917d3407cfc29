pgbus migrate >/dev/null
# The direct connection to the database, for LISTEN.
DIRECT_URL=$DATABASE_URL
run <<CMD
DATABASE_URL=postgres://$POOLER_USER@127.0.0.1:$POOLER_PORT/$DB_NAME pgbus consume --pooler \\
    --listen-url "\$DIRECT_URL" -s audit -p 'order.*' &
CMD
consumer=$!
await 'consuming "audit"'
interrupt "$consumer"
