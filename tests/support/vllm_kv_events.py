"""vLLM's own KV-event code (``vllm/distributed/kv_events.py``), loaded from a vLLM wheel.

vLLM cannot be installed here (it pulls in CUDA builds of torch), but its event publisher is one
file that needs only msgspec and pyzmq. :func:`load` reads that file out of a wheel and executes
it with the five vLLM imports it names replaced by small stand-ins (a logger, a config record,
network helpers, the ``ExternalBlockHash`` alias): the classes that encode the events
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, ``KVEventBatch``) and the publisher
(``ZmqEventPublisher``: PUB socket, replay ROUTER, sequence numbers, end marker) are vLLM's, run
unchanged. The one thing changed is where the publisher binds: vLLM binds wildcard endpoints only
(``tcp://*:5557``), and tests stay on loopback, so :func:`publisher` binds ``127.0.0.1``. For a
lost message, :func:`drop_next` puts a lossy stand-in in front of its PUB socket: the batches
are numbered and buffered for replay by vLLM's code as always, only not sent.

Used by ``bench/vllm_kv_events_check.py`` (vLLM's publisher against ``lig kv-events``) and to
regenerate ``tests/fixtures/vllm_kv_events/`` (the bytes vLLM sends, which the suite checks
without a wheel).
"""

from __future__ import annotations

import ipaddress
import logging
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

from simulator.kv_events import KVEventsConfig

SOURCE = "vllm/distributed/kv_events.py"


def _split_zmq_path(path: str) -> tuple[str, str, str]:
    scheme, _, rest = path.partition("://")
    host, _, port = rest.rpartition(":")
    return scheme, host.strip("[]"), port


def _is_ipv6(address: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(address), ipaddress.IPv6Address)
    except ValueError:
        return False


def _stand_ins() -> dict[str, types.ModuleType]:
    """The modules vLLM's file imports, reduced to what it uses."""
    config = types.ModuleType("vllm.config.kv_events")
    # The publisher only records it; the simulator's copy of vLLM's config has its fields.
    config.KVEventsConfig = KVEventsConfig  # type: ignore[attr-defined]
    logger = types.ModuleType("vllm.logger")
    logger.init_logger = logging.getLogger  # type: ignore[attr-defined]
    network = types.ModuleType("vllm.utils.network_utils")
    network.get_ip = lambda: "127.0.0.1"  # type: ignore[attr-defined]
    network.get_tcp_uri = lambda ip, port: f"tcp://{ip}:{port}"  # type: ignore[attr-defined]
    network.is_valid_ipv6_address = _is_ipv6  # type: ignore[attr-defined]
    network.split_zmq_path = _split_zmq_path  # type: ignore[attr-defined]
    cache_utils = types.ModuleType("vllm.v1.core.kv_cache_utils")
    cache_utils.ExternalBlockHash = bytes | int  # type: ignore[attr-defined]
    return {module.__name__: module for module in (config, logger, network, cache_utils)}


def load(wheel: Path) -> types.ModuleType:
    """vLLM's ``kv_events`` module from ``wheel`` (a vLLM ``.whl``), as ``vllm_kv_events``."""
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read(SOURCE).decode()
    saved = {name: sys.modules.get(name) for name in _stand_ins()}
    sys.modules.update(_stand_ins())
    try:
        module = types.ModuleType("vllm_kv_events")
        module.__file__ = f"{wheel}!/{SOURCE}"
        # msgspec resolves the Structs' annotations through the module's namespace.
        sys.modules[module.__name__] = module
        exec(compile(source, module.__file__, "exec"), module.__dict__)
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    return module


class _LossyPub:
    """vLLM's PUB socket, losing the next ``drop`` messages (what a subscriber past its
    high-water mark, or on a flaky link, sees)."""

    def __init__(self, socket: Any, drop: int) -> None:
        self.socket = socket
        self.drop = drop

    def send_multipart(self, frames: Any, *args: Any, **kwargs: Any) -> Any:
        if self.drop > 0:
            self.drop -= 1
            return None
        return self.socket.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.socket, name)


def drop_next(publisher: Any, count: int) -> None:
    """The next ``count`` batches ``publisher`` sends are lost on its PUB socket (its replay
    buffer keeps them)."""
    pub = publisher._pub
    if isinstance(pub, _LossyPub):
        pub.drop += count
    else:
        publisher._pub = _LossyPub(pub, count)


def publisher(module: types.ModuleType, port: int, replay_port: int | None,
              rank: int = 0, buffer_steps: int = 10_000) -> Any:
    """vLLM's ``ZmqEventPublisher`` for data-parallel rank ``rank``, bound on loopback at
    ``port`` (+ ``rank``, as vLLM offsets it) with its replay socket at ``replay_port``."""
    cls = module.ZmqEventPublisher

    class LoopbackPublisher(cls):  # type: ignore[misc, valid-type]
        """Binds ``tcp://127.0.0.1:P`` where vLLM binds only wildcard endpoints."""

        @staticmethod
        def _is_bind_endpoint(endpoint: str) -> bool:
            return True

    replay = None if replay_port is None else f"tcp://127.0.0.1:{replay_port}"
    return LoopbackPublisher(data_parallel_rank=rank, endpoint=f"tcp://127.0.0.1:{port}",
                             replay_endpoint=replay, buffer_steps=buffer_steps)
