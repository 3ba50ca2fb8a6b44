"""Least-privilege NATS permissions of each lig service, as nats-server authorization users.

What each service may do (``P`` is the subject prefix, ``B`` the registry bucket ``P-registry``,
``S`` the recording streams ``P_METRICS``, ``P_DECISIONS`` and ``P_REGISTRY``):

| user | publishes | subscribes | JetStream |
|---|---|---|---|
| registry | ``$KV.B.>`` (puts, deletes) | replies | creates, updates and reads ``KV_B`` |
| collector | ``P.metrics.>``, ``P.collectors.>`` | ``P.collectors.*`` | manages ``S``; reads KV |
| kv-events | ``P.kvblocks.>``, ``P.kvevents.>`` | ``P.kvevents.*`` | manages ``P_KVBLOCKS``; KV |
| picker | ``P.decisions.>``, ``P.records.>`` | ``P.{metrics,kvblocks,decisions}.>`` | ``KV_B`` (1)|
| status | nothing | ``P.{metrics,kvblocks,records}.>``, ``P.collectors.*`` | reads all three |
| replay | everything above, under its own prefix only | same | same, on its own bucket/stream |

(1) and reads ``P_KVBLOCKS`` (the precise prefix index's history at start).

JetStream is reached by requests to ``$JS.API.<verb>.<stream>...``; the reply comes back on the
client's ``_INBOX.>``. No user may *publish* to ``_INBOX.>``: that would let it forge answers to
another service's JetStream requests (a fake registry entry, say). Reading a KV bucket also
needs consumer creation (its watcher), direct gets and flow-control replies on ``$JS.FC``.
``status`` is also the account for ``lig record`` (read only): the pickers' decision records
(``P.records.>``) are recorded in ``P_DECISIONS``, which it reads. The collector creates all the
recording streams; the registry recording sources the bucket's stream inside the server, which
needs no client permission on the bucket beyond creating the sourcing stream.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from shared.subjects import Subjects

JS_API = "$JS.API"
REPLIES = "_INBOX.>"
SERVICES = ("registry", "collector", "kv-events", "picker", "status", "replay")


class SubjectRules(msgspec.Struct, frozen=True):
    """nats-server's ``allow`` list for one direction."""

    allow: list[str]


class Permissions(msgspec.Struct, frozen=True):
    """nats-server's ``permissions`` block of one user."""

    publish: SubjectRules
    subscribe: SubjectRules


def _read_stream(stream: str) -> list[str]:
    """Requests needed to read a stream: info, ephemeral/ordered consumers, gets, flow control."""
    return [
        f"{JS_API}.INFO",
        f"{JS_API}.STREAM.INFO.{stream}",
        f"{JS_API}.CONSUMER.CREATE.{stream}",
        f"{JS_API}.CONSUMER.CREATE.{stream}.>",
        f"{JS_API}.CONSUMER.INFO.{stream}.>",
        f"{JS_API}.CONSUMER.DELETE.{stream}.>",
        f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.>",
        f"{JS_API}.DIRECT.GET.{stream}",
        f"{JS_API}.DIRECT.GET.{stream}.>",
        f"{JS_API}.STREAM.MSG.GET.{stream}",
        f"$JS.FC.{stream}.>",
        f"$JS.ACK.{stream}.>",
    ]


def _manage_stream(stream: str) -> list[str]:
    """Requests needed to create a stream and keep its configuration (replicas, limits)."""
    return [f"{JS_API}.STREAM.CREATE.{stream}", f"{JS_API}.STREAM.UPDATE.{stream}",
            *_read_stream(stream)]


def kv_stream(subjects: Subjects) -> str:
    """The stream behind the registry bucket."""
    return f"KV_{subjects.registry_bucket}"


def decisions(subjects: Subjects) -> str:
    """Subjects reserved for the pickers' shared decisions (and their future stream)."""
    return f"{subjects.prefix}.decisions.>"


def records(subjects: Subjects) -> str:
    """Subjects of the pickers' decision records (the flight recorder, recorded in
    ``P_DECISIONS``)."""
    return f"{subjects.prefix}.records.>"


def _recordings(subjects: Subjects, rules: Callable[[str], list[str]]) -> list[str]:
    """``rules`` applied to every recording stream."""
    return [rule for stream in (subjects.metrics_stream, subjects.decisions_stream,
                                subjects.registry_stream) for rule in rules(stream)]


def _unique(rules: list[str]) -> list[str]:
    return list(dict.fromkeys(rules))


def service_permissions(service: str, subjects: Subjects, replay: Subjects) -> Permissions:
    """The permissions of ``service`` (one of :data:`SERVICES`) under ``subjects``'s prefix;
    ``replay`` is the prefix the replay user owns."""
    bucket = kv_stream(subjects)
    heartbeats = f"{subjects.prefix}.collectors.>"
    if service == "registry":
        publish = [f"$KV.{subjects.registry_bucket}.>", *_manage_stream(bucket)]
        subscribe: list[str] = []
    elif service == "collector":
        publish = [subjects.all_metrics(), heartbeats, *_recordings(subjects, _manage_stream),
                   *_read_stream(bucket)]
        subscribe = [subjects.all_collector_heartbeats()]
    elif service == "kv-events":
        publish = [subjects.all_kv_blocks(), f"{subjects.prefix}.kvevents.>",
                   *_manage_stream(subjects.kv_blocks_stream), *_read_stream(bucket)]
        subscribe = [subjects.all_kv_events_heartbeats()]
    elif service == "picker":
        publish = [decisions(subjects), records(subjects), *_read_stream(bucket),
                   *_read_stream(subjects.kv_blocks_stream)]
        subscribe = [subjects.all_metrics(), subjects.all_kv_blocks(), decisions(subjects)]
    elif service == "status":
        publish = [*_read_stream(bucket), *_recordings(subjects, _read_stream),
                   *_read_stream(subjects.kv_blocks_stream)]
        subscribe = [subjects.all_metrics(), subjects.all_kv_blocks(),
                     subjects.all_collector_heartbeats(), records(subjects)]
    elif service == "replay":
        # Everything the producing services may do, but only under the replay prefix.
        parts = [service_permissions(name, replay, replay)
                 for name in ("registry", "collector", "kv-events", "picker", "status")]
        publish = [rule for part in parts for rule in part.publish.allow]
        subscribe = [rule for part in parts for rule in part.subscribe.allow]
    else:
        raise ValueError(f"unknown service {service!r}; one of {', '.join(SERVICES)}")
    return Permissions(SubjectRules(_unique(publish)),
                       SubjectRules(_unique([*subscribe, REPLIES])))
