"""`python -m kgtp_sim.tools.combinations`: the combination suite's command (campaign.py), `scripts/combinations`;
on the main thread.
"""

import sys

from .campaign import main

sys.exit(main())
