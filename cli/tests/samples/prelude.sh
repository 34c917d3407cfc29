# Sourced before every scenario. `run` reads one command from its standard input (a
# quoted here-document, so it is shown exactly as written, `\` continuations included),
# prints it after `$ ` and runs it, its standard error folded into its output as a
# terminal shows both. `$?` in a command is the previous command's exit status.
__status=0
run() {
    local cmd
    cmd=$(cat)
    printf '$ %s\n' "$cmd"
    (exit "$__status")
    eval "$cmd" 2>&1
    __status=$?
}

# The transcript is a file, so a scenario can wait for what a background command has
# printed: `await PATTERN [FILE]` polls it (or FILE, the output of a command kept out of
# the transcript) with grep -E until a line matches, and fails the scenario after
# $SAMPLE_TIMEOUT seconds (20 by default).
exec >"$TRANSCRIPT" 2>&1
# Whatever a scenario started and did not stop (it failed part-way) ends with it.
trap 'pkill -KILL -P $$ 2>/dev/null || true' EXIT
# Job control: background commands get SIGINT as a terminal's Ctrl-C sends it.
set -m
await() {
    local deadline=$((SECONDS + ${SAMPLE_TIMEOUT:-20}))
    until grep -Eq -- "$1" "${2:-$TRANSCRIPT}" 2>/dev/null; do
        if ((SECONDS >= deadline)); then
            echo "sample: timed out waiting for /$1/ in ${2:-the transcript}" >&2
            exit 1
        fi
        sleep 0.05
    done
}

# `interrupt JOB` shows `^C` and sends SIGINT to a command `run` started with `&` (the
# transcript shows it as if it had run in the foreground), then waits for it to end.
interrupt() {
    echo '^C'
    kill -INT "$1"
    { wait "$1"; } 2>/dev/null
}

# `background LOG COMMAND...` starts a command kept out of the transcript, its output in
# LOG, and sets $bg to its pid; `stop PID` ends it with SIGTERM and waits for it. Such a
# command is no job of this shell, so no job notice reaches the transcript.
background() {
    local log=$1
    shift
    set +m
    "$@" >"$log" 2>&1 &
    bg=$!
    set -m
}
stop() {
    kill -TERM "$1"
    { wait "$1"; } 2>/dev/null || true
}

# `free_port` prints a TCP port of the loopback address nobody listens on now.
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# `start_nats` starts a throwaway NATS server with JetStream (nats-server on PATH), its
# store in ./nats-store, on a free port, and exports NATS_URL once it takes connections.
start_nats() {
    nats_port=$(free_port)
    background nats.log nats-server -js -a 127.0.0.1 -p "$nats_port" -sd "$PWD/nats-store"
    nats=$bg
    await 'Server is ready' nats.log
    export NATS_URL=nats://127.0.0.1:$nats_port
}
