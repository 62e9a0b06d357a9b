# The gdbserver comparison of the benchmark (kgtp_sim/bench/peer.py) needs Debian's gdbserver, which ships the
# in-process agent /usr/lib/libinproctrace.so in the same package, gdb and gcc. Source it; it defines
# `ensure_gdbserver`, which installs what is missing and fails otherwise.

. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"

ensure_gdbserver() {
    ensure_debian /usr/lib/libinproctrace.so gdbserver && ensure_debian /usr/bin/gdbserver gdbserver \
        && ensure_debian /usr/bin/gdb gdb && ensure_debian gcc gcc libc6-dev
}
