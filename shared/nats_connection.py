"""Connecting the services to NATS: flags and environment, credentials, reconnect forever."""

from __future__ import annotations

import argparse
import logging
import os
import ssl
from collections.abc import Awaitable, Callable

import msgspec
import nats
from nats.aio.client import Client

from shared.replication import replica_count
from shared.subjects import DEFAULT_PREFIX

log = logging.getLogger("lig.nats")


class NatsSettings(msgspec.Struct, frozen=True):
    """Where NATS is and how to authenticate; every field has a flag and an environment variable."""

    url: str = "nats://127.0.0.1:4222"
    prefix: str = DEFAULT_PREFIX
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    # Copies of the JetStream state this service creates (bucket, streams); see shared.replication
    replicas: int = 1


def add_nats_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the NATS flags every service shares (defaults from ``LIG_NATS_*`` variables)."""
    env = os.environ.get
    defaults = NatsSettings()  # an instance: msgspec's class attributes are field descriptors
    group = parser.add_argument_group("NATS")
    group.add_argument("--nats-url", default=env("LIG_NATS_URL", defaults.url),
                       help="NATS server URL(s), comma-separated (env LIG_NATS_URL)")
    group.add_argument("--prefix", default=env("LIG_PREFIX", DEFAULT_PREFIX),
                       help="subject prefix; the KV bucket is <prefix>-registry (env LIG_PREFIX)")
    group.add_argument("--nats-user", default=env("LIG_NATS_USER"), help="env LIG_NATS_USER")
    group.add_argument("--nats-password", default=env("LIG_NATS_PASSWORD"),
                       help="env LIG_NATS_PASSWORD")
    group.add_argument("--nats-token", default=env("LIG_NATS_TOKEN"), help="env LIG_NATS_TOKEN")
    group.add_argument("--nats-creds", default=env("LIG_NATS_CREDS"),
                       help="NATS credentials file (env LIG_NATS_CREDS)")
    group.add_argument("--nats-tls-ca", default=env("LIG_NATS_TLS_CA"),
                       help="CA bundle to verify the server (env LIG_NATS_TLS_CA)")
    group.add_argument("--nats-tls-cert", default=env("LIG_NATS_TLS_CERT"),
                       help="client certificate for mutual TLS (env LIG_NATS_TLS_CERT)")
    group.add_argument("--nats-tls-key", default=env("LIG_NATS_TLS_KEY"),
                       help="client key for mutual TLS (env LIG_NATS_TLS_KEY)")
    group.add_argument("--nats-replicas", type=replica_count,
                       default=env("LIG_NATS_REPLICAS", str(defaults.replicas)),
                       help="JetStream replicas of the registry bucket and the recording stream: "
                            "1 for a single server, 3 on a cluster; existing ones are updated "
                            "to this count (env LIG_NATS_REPLICAS)")


def settings_from_args(args: argparse.Namespace) -> NatsSettings:
    """Collect the flags added by :func:`add_nats_arguments`."""
    return NatsSettings(
        url=args.nats_url, prefix=args.prefix, user=args.nats_user, password=args.nats_password,
        token=args.nats_token, creds_file=args.nats_creds, tls_ca=args.nats_tls_ca,
        tls_cert=args.nats_tls_cert, tls_key=args.nats_tls_key,
        replicas=args.nats_replicas,
    )


def _tls_context(settings: NatsSettings) -> ssl.SSLContext | None:
    if not (settings.tls_ca or settings.tls_cert):
        return None
    context = ssl.create_default_context(cafile=settings.tls_ca)
    if settings.tls_cert:
        context.load_cert_chain(settings.tls_cert, settings.tls_key)
    return context


async def connect(
    settings: NatsSettings,
    name: str,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
) -> Client:
    """Connect and keep reconnecting forever (the services must outlive NATS restarts).

    The first connection is retried too, so a service may start before NATS does.
    """

    async def error_cb(exc: Exception) -> None:
        log.warning("nats error (%s): %s", name, exc or type(exc).__name__)

    async def disconnected_cb() -> None:
        log.warning("nats disconnected (%s)", name)
        if on_disconnect is not None:
            await on_disconnect()

    async def reconnected_cb() -> None:
        log.info("nats reconnected (%s)", name)
        if on_reconnect is not None:
            await on_reconnect()

    return await nats.connect(
        servers=[url.strip() for url in settings.url.split(",")],
        name=name,
        user=settings.user,
        password=settings.password,
        token=settings.token,
        user_credentials=settings.creds_file,
        tls=_tls_context(settings),
        allow_reconnect=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=2,
        ping_interval=5,
        max_outstanding_pings=2,
        error_cb=error_cb,
        disconnected_cb=disconnected_cb,
        reconnected_cb=reconnected_cb,
    )
