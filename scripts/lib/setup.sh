# Shared set-up for scripts/*: a project venv with the package installed, redone only when pyproject changes.
# Source it from the repository root; it defines `ensure_venv [extras]` and `ensure_gdb`.

ensure_venv() {
    local extras="${1:-}"
    local python="${PYTHON:-python3}"
    if [ ! -x .venv/bin/python ]; then
        "$python" -m venv .venv
    fi
    local stamp=".venv/.kgtp-installed${extras:+-$extras}"
    local want
    want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
        .venv/bin/python -m pip install --quiet -e ".${extras:+[$extras]}"
        echo "$want" > "$stamp"
    fi
}

ensure_gdb() {
    if command -v gdb >/dev/null 2>&1; then
        return 0
    fi
    echo "gdb is missing: installing Debian's gdb" >&2
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq gdb >/dev/null
}
