"""`python -m fedmq ...`: the same as the `fedmq` command (used to start child processes
with the running interpreter, whatever is on PATH)."""

import sys

from fedmq.cli import main

sys.exit(main())
