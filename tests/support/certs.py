"""Throwaway certificates for TLS tests, made with the ``openssl`` command line tool."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import msgspec


class TestCertificates(msgspec.Struct, frozen=True):
    """PEM paths: a CA, a server certificate for 127.0.0.1/localhost, a client certificate."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def make_certificates(directory: Path) -> TestCertificates:
    """A CA and two certificates it signed, valid for one day, in ``directory``."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the openssl command is needed to make test certificates")
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, cwd=directory)

    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run("req", "-x509", *curve, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=lig-test-ca")
    for name, extensions in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (directory / f"{name}.ext").write_text(extensions)
        run("req", *curve, "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN=lig-test-{name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext")
    return TestCertificates(
        ca=str(directory / "ca.pem"),
        server_cert=str(directory / "server.pem"), server_key=str(directory / "server.key"),
        client_cert=str(directory / "client.pem"), client_key=str(directory / "client.key"))
