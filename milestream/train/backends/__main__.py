"""A rank started by ``launch`` under torchrun: ``python -m milestream.train.backends ENTRY CONFIG``."""
import sys

from milestream.train.backends.launcher import run_rank

run_rank(*sys.argv[1:])
