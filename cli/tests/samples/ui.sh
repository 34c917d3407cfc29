pgbus migrate >/dev/null
port=$(free_port)
run <<CMD
pgbus ui --allow-actions --listen 127.0.0.1:$port &
CMD
ui=$!
await 'dashboard on'
interrupt "$ui"
