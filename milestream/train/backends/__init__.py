"""Training backends behind one interface: local (the single-process reference), FSDP2, Megatron-core.

See ``base`` for the interface and how a distributed trainer uses it, ``launcher`` for how one
configuration flag (``trainer.backend``) starts the right number of processes.
"""
from milestream.train.backends.base import StepResult, TrainBackend, make_backend
from milestream.train.backends.launcher import launch

__all__ = ["StepResult", "TrainBackend", "launch", "make_backend"]
