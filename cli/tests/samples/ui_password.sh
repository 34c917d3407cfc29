pgbus migrate >/dev/null
port=$(free_port)
run <<CMD
PGBUS_UI_PASSWORD=secret pgbus ui --listen 0.0.0.0:$port --allowed-host dash.example &
CMD
ui=$!
await 'dashboard on'
interrupt "$ui"
