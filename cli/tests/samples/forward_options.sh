pgbus migrate >/dev/null
# Two throwaway NATS servers with JetStream that take the user relay (password secret).
ports=()
for n in 1 2; do
    port=$(free_port)
    background "nats-$n.log" nats-server -js -a 127.0.0.1 -p "$port" -sd "$PWD/nats-store-$n" \
        --user relay --pass secret
    servers+=("$bg")
    ports+=("$port")
    await 'Server is ready' "nats-$n.log"
done
# Credentials stay out of the process list: in NATS_URL, not --nats-url.
run <<CMD
export NATS_URL=nats://relay:secret@127.0.0.1:${ports[0]},nats://relay:secret@127.0.0.1:${ports[1]}
CMD
run <<'CMD'
pgbus forward -s to-nats -p 'order.*' --ordered --stream ORDERS &
CMD
forward=$!
await 'forwarding "to-nats"'
interrupt "$forward"
for server in "${servers[@]}"; do stop "$server"; done
