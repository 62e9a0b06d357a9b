"""`python -m kgtp_sim`: the `kgtp-sim` command (cli.py), which runs on the main thread. `kgtp-sim gdbserver` with
KGTP_SIM_WARM set is offered to that warm server (launch.py, warm.py) before cli.py and its imports load; such a
launcher may run as `python -S` (reading the site-packages made a 45 ms warm start 50 ms), and loads them only where
it starts the server itself."""

import sys

from .launch import offer

offer(sys.argv[1:])  # `gdbserver ...` with KGTP_SIM_WARM set: returns only where no warm server listens

if sys.flags.no_site:  # `python -S`, as a launcher of warm starts may run (no site-packages read): a cold start
    import site       # needs them

    site.main()

from .cli import entry

entry(warm=False)  # offered above
