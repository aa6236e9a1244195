"""A rank started by ``launch`` under torchrun: ``python -m milestream.consumers.backends ENTRY CONFIG``."""
import sys

from milestream.consumers.backends.launcher import run_rank

run_rank(*sys.argv[1:])
