"""The picker's TLS flags: clear errors for incomplete or unusable files (no network)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.picker.main import configure, settings_from
from services.picker.tls import TlsFiles, ssl_context
from shared.errors import ConfigError
from tests.support.certs import make_certificates


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(argv)


def tls_from_args(args: argparse.Namespace) -> TlsFiles | None:
    return settings_from(args).tls


def test_no_flags_means_plaintext(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LIG_PICKER_TLS_CERT", "LIG_PICKER_TLS_KEY", "LIG_PICKER_TLS_CLIENT_CA",
                 "LIG_TLS_CERT", "LIG_TLS_KEY", "LIG_TLS_CLIENT_CA"):
        monkeypatch.delenv(name, raising=False)
    assert tls_from_args(parse()) is None


def test_valid_files_give_contexts_with_h2(tmp_path: Path) -> None:
    certs = make_certificates(tmp_path)
    files = tls_from_args(parse("--tls-cert", certs.server_cert, "--tls-key", certs.server_key,
                                "--tls-client-ca", certs.ca))
    assert files == TlsFiles(certs.server_cert, certs.server_key, certs.ca)
    assert ssl_context(files).verify_mode.name == "CERT_REQUIRED"


@pytest.mark.parametrize("case", ["key-missing", "unreadable", "not-a-certificate"])
def test_wrong_flags_exit_with_one_line(tmp_path: Path, case: str) -> None:
    certs = make_certificates(tmp_path)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    argv = {
        "key-missing": ("--tls-cert", certs.server_cert),
        "unreadable": ("--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", certs.server_key),
        "not-a-certificate": ("--tls-cert", str(garbage), "--tls-key", certs.server_key),
    }[case]
    with pytest.raises(ConfigError) as error:
        tls_from_args(parse(*argv))
    message = str(error.value)
    assert "TLS" in message and "\n" not in message
