"""A gray pod: a simulated vLLM pod whose metrics say idle but which never answers a completion.

It serves ``/metrics`` (an idle engine's page), ``/health`` and ``/v1/models`` like ``lig sim``
and holds every ``/v1/completions`` and ``/v1/chat/completions`` request until the client gives
up: the failure a scraper cannot see (issue 13 item 9). Takes ``lig sim``'s flags; the pod
listens on ``--base-port``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from shared.logs import setup_logging
from shared.service import run_service
from simulator.http_app import SimulatedPod
from simulator.http_server import HttpRequest, Response, StreamResponse, serve
from simulator.main import configure as configure_sim
from simulator.main import settings_from_args
from simulator.openai_api import error_body

log = logging.getLogger(__name__)

HELD_PATHS = ("/v1/completions", "/v1/chat/completions")


def configure(parser: argparse.ArgumentParser) -> None:
    """``lig sim``'s flags (one pod, on ``--base-port``)."""
    configure_sim(parser)


def run(args: argparse.Namespace) -> int:
    """Serve the gray pod until SIGTERM/SIGINT."""
    setup_logging("gray-pod", args.log_level)
    settings = settings_from_args(args)[0]

    async def main(stop: asyncio.Event) -> int:
        # Never started: its engine never steps, so its metrics page stays that of an idle pod.
        pod = SimulatedPod(settings)

        async def handle(request: HttpRequest) -> Response | StreamResponse:
            if request.path in HELD_PATHS:
                await stop.wait()  # never answered while the pod runs
                return Response(503, error_body(503, "gray pod stopping"))
            return await pod.handle(request)

        server = await serve(handle, error_body, args.host, args.base_port)
        log.info("gray pod of %s on %s:%d: idle metrics, completions never answered",
                 settings.engine.model, args.host, args.base_port)
        await stop.wait()
        server.close()
        return 0

    return run_service(main)
