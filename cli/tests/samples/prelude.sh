# Sourced before every scenario. `run CMD...` prints `$ CMD` as the docs show it, then
# runs CMD with its standard error folded into its output (as a terminal shows both).
run() {
    printf '$ %s\n' "$*"
    eval "$*" 2>&1
}
