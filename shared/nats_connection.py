"""Connecting the services to NATS: settings (flags and environment), credentials, reconnect
forever, and a bounded close."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated

import msgspec
import nats
from nats.aio.client import Client

from shared.host.settings import add_flags, from_args, option
from shared.replication import MAX_REPLICAS
from shared.service import cancel_and_wait, finish_within
from shared.subjects import DEFAULT_PREFIX

log = logging.getLogger("lig.nats")


class NatsSettings(msgspec.Struct, frozen=True):
    """Where NATS is and how to authenticate; every field has a flag and an environment variable."""

    url: Annotated[str, option("NATS server URL(s), comma-separated",
                               flag="--nats-url")] = "nats://127.0.0.1:4222"
    prefix: Annotated[str, option("subject prefix; the KV bucket is <prefix>-registry",
                                  min_length=1)] = DEFAULT_PREFIX
    user: Annotated[str | None, option("NATS user name", flag="--nats-user")] = None
    password: Annotated[str | None, option("NATS password", flag="--nats-password")] = None
    token: Annotated[str | None, option("NATS token", flag="--nats-token")] = None
    creds_file: Annotated[str | None, option("NATS credentials file", flag="--nats-creds")] = None
    tls_ca: Annotated[str | None, option("CA bundle to verify the server",
                                         flag="--nats-tls-ca")] = None
    tls_cert: Annotated[str | None, option("client certificate for mutual TLS",
                                           flag="--nats-tls-cert")] = None
    tls_key: Annotated[str | None, option("client key for mutual TLS",
                                          flag="--nats-tls-key")] = None
    # Copies of the JetStream state this service creates (bucket, streams); see shared.replication
    replicas: Annotated[int, option(
        "JetStream replicas of the registry bucket and the recording stream: 1 for a single "
        "server, 3 on a cluster; existing ones are updated to this count",
        flag="--nats-replicas", ge=1, le=MAX_REPLICAS)] = 1


_GROUP = "nats__"  # the flags' group (and argparse prefix) when used outside a service Struct


def add_nats_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the NATS flags alone (for commands that have no settings Struct, ``lig status``)."""
    add_flags(parser, NatsSettings, _GROUP)


def nats_url_given(args: argparse.Namespace) -> bool:
    """True when ``--nats-url`` was on the command line (of :func:`add_nats_arguments`)."""
    return getattr(args, _GROUP + "url", None) is not None


def settings_from_args(args: argparse.Namespace) -> NatsSettings:
    """The settings of the flags added by :func:`add_nats_arguments` (then ``LIG_NATS_*``...)."""
    settings: NatsSettings = from_args(NatsSettings, args, prefix=_GROUP)
    return settings


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
    no_echo: bool = False,
) -> Client:
    """Connect and keep reconnecting forever (the services must outlive NATS restarts).

    The first connection is retried too, so a service may start before NATS does. With
    ``no_echo`` the server does not deliver this connection's own publishes to its own
    subscriptions.
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
        no_echo=no_echo,
    )


@contextlib.asynccontextmanager
async def connection(
    settings: NatsSettings,
    name: str,
    stop: asyncio.Event,
    *,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
    drain: bool = False,
    close_within: float = 1.0,
    no_echo: bool = False,
) -> AsyncIterator[Client | None]:
    """A connection for the block, or None when ``stop`` was set before NATS answered.

    On the way out the connection is drained (``drain``: pending publishes go out, the
    subscriptions end) or closed, within ``close_within`` seconds either way. ``no_echo``: as
    :func:`connect`.
    """
    connecting = asyncio.create_task(connect(settings, name, on_reconnect=on_reconnect,
                                             on_disconnect=on_disconnect, no_echo=no_echo))
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not connecting.done():
            await cancel_and_wait(connecting)  # nats-py's connect may swallow one cancel
    if connecting.cancelled() or not connecting.done():
        yield None
        return
    client = connecting.result()
    try:
        yield client
    finally:
        await finish_within(client.drain() if drain else client.close(), close_within)
