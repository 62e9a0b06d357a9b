# Shared set-up for scripts/*: a project venv with the package installed, redone only when pyproject changes.
# Source it from the repository root; it defines `ensure_venv [extras]` and `ensure_gdb`.
# What pip and apt print goes to .venv/setup.log (or /tmp for the first venv); it is shown only on failure.

_setup_log() {
    if [ -d .venv ]; then echo ".venv/setup.log"; else echo "${TMPDIR:-/tmp}/kgtp-sim-setup.log"; fi
}

# run QUIETLY: the command's output goes to the set-up log, which is named (and its tail shown) only on failure.
_quietly() {
    local log
    log="$(_setup_log)"
    if ! "$@" >>"$log" 2>&1; then
        echo "set-up step failed: $*" >&2
        echo "--- last lines of $log ---" >&2
        tail -n 30 "$log" >&2
        return 1
    fi
}

# True when an earlier install of the same pyproject.toml covered every extra asked for now: `scripts/serve`
# after `scripts/test` reuses the test install (its extras are a superset) instead of installing again.
_installed_covers() {
    local want="$1" extras="$2" stamp have
    for stamp in .venv/.kgtp-installed*; do
        [ -f "$stamp" ] || continue
        [ "$(cat "$stamp")" = "$want" ] || continue
        have=",${stamp#.venv/.kgtp-installed-},"
        [ "$stamp" = ".venv/.kgtp-installed" ] && have=","
        local extra ok=1
        for extra in ${extras//,/ }; do
            case "$have" in *",$extra,"*) ;; *) ok=0 ;; esac
        done
        [ "$ok" = 1 ] && return 0
    done
    return 1
}

# The extras an earlier install of the same pyproject.toml had, with EXTRAS added: comma-separated, sorted.
# pip adds packages and never removes them, so after `ensure_venv view` a venv that had `test,bench` still has
# them, and its stamp says so: the scripts asking for different extras do not take turns reinstalling.
_extras_with() {
    local want="$1" extras="$2" stamp all=""
    for stamp in .venv/.kgtp-installed-*; do
        [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] || continue
        all="$all,${stamp#.venv/.kgtp-installed-}"
    done
    echo "$all,$extras" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -
}

ensure_venv() {
    local extras="${1:-}"
    local python="${PYTHON:-python3}"
    if [ ! -x .venv/bin/python ]; then
        _quietly "$python" -m venv .venv
    fi
    local want
    want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
    if ! _installed_covers "$want" "$extras"; then
        extras="$(_extras_with "$want" "$extras")"
        echo "setting up .venv (first run, pyproject.toml changed, or new extras): .${extras:+[$extras]}..." >&2
        _quietly .venv/bin/python -m pip install --upgrade pip
        _quietly .venv/bin/python -m pip install -e ".${extras:+[$extras]}"
        rm -f .venv/.kgtp-installed*
        echo "$want" > ".venv/.kgtp-installed${extras:+-$extras}"
    fi
}

# ensure_debian PATH PACKAGE... : install Debian's PACKAGEs (through sudo when not root) unless PATH exists
# (a file, or a command name found on PATH). Fails when they cannot be installed.
ensure_debian() {
    local want="$1"
    shift
    if [ -e "$want" ] || { [ "${want#/}" = "$want" ] && command -v "$want" >/dev/null 2>&1; }; then
        return 0
    fi
    echo "installing Debian's $* (for $want)" >&2
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null 2>&1 || { echo "not root and no sudo: cannot install $*" >&2; return 1; }
        sudo="sudo -n"
    fi
    _quietly $sudo apt-get update -qq || return 1
    DEBIAN_FRONTEND=noninteractive _quietly $sudo apt-get install -y -qq "$@"
}

ensure_gdb() {
    ensure_debian gdb gdb
}
