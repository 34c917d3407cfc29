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
