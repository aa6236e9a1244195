"""A throw-away certificate authority for TLS tests: a CA, a server certificate for 127.0.0.1 and a client
certificate, made with the openssl command (no Python package for X.509 is installed)."""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certificates(folder: Path) -> Certificates:
    """Skips the test where there is no openssl command (.ci/run installs it)."""
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
