"""TLS for the picker's ext_proc port: a server certificate, and optionally client certificates
(mutual TLS) checked against a CA. The health port stays plaintext: it carries no request data,
and probes and Envoy's health checks reach it without certificates.
"""

from __future__ import annotations

import argparse
import os
import ssl
from pathlib import Path

import grpc
import msgspec


class TlsFiles(msgspec.Struct, frozen=True):
    """PEM files: the server's certificate chain and key, and the CA for client certificates."""

    cert: str
    key: str
    client_ca: str | None = None


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--tls-*`` flags (and their environment variables)."""
    env = os.environ.get
    parser.add_argument("--tls-cert", default=env("LIG_PICKER_TLS_CERT"),
                        help="PEM certificate chain: serve ext_proc over TLS (with --tls-key) "
                        "(env LIG_PICKER_TLS_CERT)")
    parser.add_argument("--tls-key", default=env("LIG_PICKER_TLS_KEY"),
                        help="PEM private key of --tls-cert (env LIG_PICKER_TLS_KEY)")
    parser.add_argument("--tls-client-ca", default=env("LIG_PICKER_TLS_CLIENT_CA"),
                        help="PEM CA bundle: require client certificates it signed, i.e. "
                        "mutual TLS (env LIG_PICKER_TLS_CLIENT_CA)")


def tls_from_args(args: argparse.Namespace) -> TlsFiles | None:
    """The TLS files the flags name (None: plaintext); exits with one line when they are wrong."""
    if not (args.tls_cert or args.tls_key or args.tls_client_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        raise SystemExit("picker: TLS needs both --tls-cert and --tls-key")
    files = TlsFiles(args.tls_cert, args.tls_key, args.tls_client_ca)
    for path in (files.cert, files.key, files.client_ca):
        if path is not None and not os.access(path, os.R_OK):
            raise SystemExit(f"picker: cannot read TLS file {path}")
    ssl_context(files)  # fail at start, with the reason, on a bad certificate or key
    return files


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
        raise SystemExit(f"picker: unusable TLS files ({exc})") from None
    return context


def grpc_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """The same for the grpc.aio server."""
    client_ca = Path(files.client_ca).read_bytes() if files.client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(Path(files.key).read_bytes(), Path(files.cert).read_bytes())],
        root_certificates=client_ca, require_client_auth=client_ca is not None)
