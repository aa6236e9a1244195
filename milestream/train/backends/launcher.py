"""One launch flag picks the backend: ``launch(cfg, entry, nproc)`` runs ``entry(cfg)`` where it must run.

``entry`` is an import path (``package.module:function``) to a function of the configuration,
e.g. ``milestream.train.trainer:run_trainer``. With ``trainer.backend=local`` it is called in
this process. With ``fsdp2`` (``nproc`` data-parallel ranks) or ``megatron`` (tensor parallel
size ``nproc``) it runs on ``nproc`` ranks, one per GPU where there are GPUs, under torchrun
(``python -m torch.distributed.run --standalone``, which picks a free rendezvous port): the
configuration travels as a YAML file, every rank loads it and calls ``entry``, and the backend
that ``entry`` builds with ``make_backend`` joins the process group from torchrun's environment.
A rank that fails fails the launch (``CalledProcessError``).

The command line can wire its flag straight through::

    milestream train --set trainer.backend=fsdp2   ->   launch(cfg, "milestream.train.trainer:run_trainer", 2)

and a rank can be started by hand the same way torchrun starts it::

    torchrun --nproc-per-node 2 -m milestream.train.backends ENTRY CONFIG.yaml
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from milestream.config import Config, import_path, load_config
from milestream.infra.secret_env import stage_environment
from milestream.train.backends.base import check_backend

_STOP_GRACE_S = 30.0


def launch(cfg: Config, entry: str, nproc: int = 2, timeout_s: float | None = None) -> None:
    run = import_path(entry, "launch entry")  # fail here, not on every rank
    check_backend(cfg)
    if cfg.trainer.backend == "local":
        run(cfg)
        return
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    with tempfile.TemporaryDirectory(prefix="milestream-launch-") as folder:
        config_file = Path(folder) / "config.yaml"
        config_file.write_text(cfg.to_yaml())  # without secrets: the ranks get them in their environment
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", "milestream.train.backends", entry, str(config_file)]
        _run_torchrun(command, timeout_s, stage_environment(cfg))


def _run_torchrun(command: list[str], timeout_s: float | None, env: dict[str, str]) -> None:
    from milestream.infra.services import die_with_parent

    # a killed trainer takes its ranks along
    process = subprocess.Popen(command, env=env, preexec_fn=die_with_parent)
    try:
        code = process.wait(timeout=timeout_s)
    except BaseException:
        # torchrun passes SIGTERM on to its ranks; killing it outright would orphan them
        process.terminate()
        try:
            process.wait(timeout=_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
        raise
    if code:
        raise subprocess.CalledProcessError(code, command)


def run_rank(entry: str, config_file: str) -> None:
    """What each rank runs (``python -m milestream.train.backends ENTRY CONFIG``)."""
    import logging
    import os

    import torch.distributed as dist

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{os.environ.get('RANK', '0')} %(process)d "
                                                   "%(name)s %(levelname)s %(message)s")
    import_path(entry, "launch entry")(load_config(config_file))
    # a group left to the interpreter's exit can abort the rank (SIGABRT, "terminate called without an active
    # exception": gloo's threads outlive the interpreter, pytorch/pytorch#190489) after its work is done
    if dist.is_initialized():
        dist.destroy_process_group()
