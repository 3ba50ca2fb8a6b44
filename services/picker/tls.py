"""TLS for the picker's ext_proc port: a server certificate, and optionally client certificates
(mutual TLS) checked against a CA. The health port stays plaintext: it carries no request data,
and probes and Envoy's health checks reach it without certificates.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import grpc
import msgspec

from shared.errors import ConfigError


class TlsFiles(msgspec.Struct, frozen=True):
    """PEM files: the server's certificate chain and key, and the CA for client certificates."""

    cert: str
    key: str
    client_ca: str | None = None


def check_tls_files(files: TlsFiles) -> None:
    """Fail at start, with the reason, on an unreadable or unusable certificate or key."""
    for path in (files.cert, files.key, files.client_ca):
        if path is not None and not os.access(path, os.R_OK):
            raise ConfigError(f"cannot read TLS file {path}")
    ssl_context(files)


def ssl_context(files: TlsFiles) -> ssl.SSLContext:
    """A server context for the built-in HTTP/2 server (ALPN ``h2``, TLS 1.2 or newer)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    try:
        context.load_cert_chain(files.cert, files.key)
        if files.client_ca is not None:
            context.load_verify_locations(files.client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"unusable TLS files ({exc})") from None
    return context


def grpc_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """The same for the grpc.aio server."""
    client_ca = Path(files.client_ca).read_bytes() if files.client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(Path(files.key).read_bytes(), Path(files.cert).read_bytes())],
        root_certificates=client_ca, require_client_auth=client_ca is not None)
