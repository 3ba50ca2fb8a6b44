"""``lig sim``: simulated vLLM model servers, one engine per pod, all pods in one process.

Pod ``i`` listens on ``--base-port + i``. Each pod has its own engine, metrics page and faults;
``--seed`` makes runs reproducible (pod ``i`` draws from streams derived from the seed and ``i``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import msgspec

from scheduling.prompt_tokenizers import load_prompt_tokenizer
from shared.errors import ConfigError
from shared.kv_events import ENCODINGS, HASH_TYPES
from shared.logs import add_logging_arguments, setup_logging
from shared.service import run_service
from simulator.engine import EngineConfig
from simulator.http_app import GRAY_MODES, Faults, PodSettings, SimulatedPod
from simulator.kv_events import KVEventsConfig, Wire, parse_config
from simulator.metrics_page import FORMATS
from simulator.profiles import DEFAULT_PROFILE, PROFILES, load_profile

log = logging.getLogger("lig.sim")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``lig sim`` flags."""
    parser.add_argument("--pods", type=int, default=1, help="simulated pods in this process")
    parser.add_argument("--host", default="127.0.0.1", help="address every pod listens on")
    parser.add_argument("--base-port", type=int, default=8000, help="port of pod 0; pod i: +i")
    parser.add_argument("--model", default=EngineConfig().model, help="served base model name")
    parser.add_argument(
        "--lora", action="append", default=[], metavar="NAME",
        help="a LoRA adapter the pods serve (repeatable)",
    )
    parser.add_argument("--max-loras", type=int, default=4, help="adapters per batch")
    parser.add_argument(
        "--max-cpu-loras", type=int, default=None,
        help="adapters kept in CPU memory (default: --max-loras)"
    )
    parser.add_argument(
        "--time-scale", type=float, default=1.0,
        help="simulated seconds per wall second (10 = ten times faster than real time)",
    )
    parser.add_argument("--metrics-format", choices=FORMATS, default="v1",
                        help="vLLM /metrics layout: v1 (engine label, kv_cache_usage_perc) or v0")
    parser.add_argument("--seed", type=int, default=0, help="seed of every random draw")
    parser.add_argument(
        "--profile", default=DEFAULT_PROFILE,
        help=f"step-time profile: {', '.join(PROFILES)}, or a YAML/JSON file",
    )
    parser.add_argument("--num-gpu-blocks", type=int, help="override the profile's KV blocks")
    parser.add_argument("--max-model-len", type=int, help="override the profile's context limit")
    parser.add_argument("--jitter", type=float, help="relative std dev of step times")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="running requests cap")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="token budget of one step"
    )
    parser.add_argument("--no-prefix-caching", action="store_true", help="disable prefix reuse")
    parser.add_argument(
        "--output-len-median", type=float, default=128.0,
        help="median output tokens when a request sets no max_tokens",
    )
    parser.add_argument("--failure-rate", type=float, default=0.0, help="fault: 500s fraction")
    parser.add_argument(
        "--metrics-delay", type=float, default=0.0, help="fault: wall seconds /metrics waits"
    )
    parser.add_argument("--hang", action="store_true", help="fault: hold all requests")
    parser.add_argument(
        "--gray-pod", action="append", type=int, default=[], metavar="INDEX",
        help="fault: pod INDEX (0-based, repeatable) is gray: its /metrics shows an idle pod, "
        "but completions get no answer (--gray-mode hang) or a 500 at once (error); "
        "POST /admin/faults {\"gray\": \"\"} heals it",
    )
    parser.add_argument("--gray-mode", choices=GRAY_MODES[1:], default="hang",
                        help="how the --gray-pod pods fail")
    # KV-cache events (docs/kv-events.md).
    parser.add_argument(
        "--kv-events-config", default=None, metavar="JSON",
        help="vLLM's KV-cache event config, e.g. '{\"enable_kv_cache_events\": true, "
        "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": "
        "\"tcp://*:5558\"}'; pod i publishes on both ports + i, '*' meaning --host",
    )
    parser.add_argument(
        "--kv-events-encoding", choices=ENCODINGS, default="map",
        help="event encoding: map (tagged with \"type\", defaults left out: vLLM since "
        "mid-2026) or array (positional, vLLM up to 0.23)",
    )
    parser.add_argument(
        "--kv-events-hashes", choices=HASH_TYPES, default="int",
        help="block hashes: int (uint64, vLLM's default) or bytes (32-byte digests, vLLM with "
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)",
    )
    parser.add_argument(
        "--kv-events-replay-framing", choices=("topic", "legacy"), default="topic",
        help="replay replies with the topic frame (vLLM 0.26 and later) or without it (legacy: "
        "before 0.26)",
    )
    parser.add_argument(
        "--tokenizer", default=None, metavar="PATH",
        help="tokenize prompts with this Hugging Face tokenizer.json (or its directory; chat "
        "with the chat template of the tokenizer_config.json or chat_template.jinja beside "
        "it), as vLLM does, instead of the built-in tokenizer (lig picker's builtin:lig-sim); "
        "generated tokens keep the built-in's ids. Requests it cannot tokenize exactly "
        "(non-text content, chat without a template) get a 400",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details", action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens, the prompt tokens found in the "
        "prefix cache, as vLLM's flag of that name does (off: the details are null)",
    )
    add_logging_arguments(parser)


def settings_from_args(args: argparse.Namespace) -> list[PodSettings]:
    """Each pod's settings; raises ValueError on an invalid combination."""
    if args.pods < 1:
        raise ValueError("--pods must be >= 1")
    if not (args.base_port > 0 and args.base_port + args.pods - 1 <= 65535):
        raise ValueError("--base-port and --pods must give ports within 1..65535")
    if args.time_scale <= 0:
        raise ValueError("--time-scale must be > 0")
    if len(set(args.lora)) != len(args.lora) or args.model in args.lora:
        raise ValueError("--lora names must be distinct and differ from --model")
    profile = load_profile(args.profile)
    overrides = {
        field: value
        for field, value in (
            ("num_gpu_blocks", args.num_gpu_blocks),
            ("max_model_len", args.max_model_len),
            ("jitter", args.jitter),
        )
        if value is not None
    }
    profile = msgspec.structs.replace(profile, **overrides).validate()
    engine = EngineConfig(
        model=args.model,
        profile=profile,
        adapters=tuple(args.lora),
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    if engine.max_loras < 1 or engine.max_num_seqs < 1 or engine.max_num_batched_tokens < 1:
        raise ValueError("--max-loras, --max-num-seqs, --max-num-batched-tokens must be >= 1")
    faults = Faults(args.failure_rate, args.metrics_delay, args.hang).validate()
    gray = set(args.gray_pod)
    if not gray <= set(range(args.pods)):
        raise ValueError("--gray-pod must name pods 0..--pods-1")
    gray_faults = msgspec.structs.replace(faults, gray=args.gray_mode)
    kv_events = parse_config(args.kv_events_config) if args.kv_events_config else \
        KVEventsConfig()
    return [
        PodSettings(
            engine=engine,
            index=index,
            time_scale=args.time_scale,
            metrics_format=args.metrics_format,
            seed=args.seed,
            output_len_median=args.output_len_median,
            faults=gray_faults if index in gray else faults,
            kv_events=kv_events,
            kv_events_wire=Wire(args.kv_events_encoding, args.kv_events_hashes,
                                args.kv_events_replay_framing == "topic"),
            tokenizer=args.tokenizer,
            prompt_tokens_details=args.enable_prompt_tokens_details,
        )
        for index in range(args.pods)
    ]


def run(args: argparse.Namespace) -> int:
    """Serve the pods until SIGTERM/SIGINT."""
    setup_logging("sim", args.log_level)
    try:
        pods_settings = settings_from_args(args)
        prompt_tokenizer = (load_prompt_tokenizer(args.tokenizer)
                            if args.tokenizer is not None else None)
    except ValueError as error:  # TokenizerLoadError included
        raise ConfigError(f"invalid settings: {error}") from None

    async def main(stop: asyncio.Event) -> int:
        pods = [SimulatedPod(settings, prompt_tokenizer) for settings in pods_settings]
        try:
            for index, pod in enumerate(pods):
                await pod.start(args.host, args.base_port + index)
        except OSError as error:
            log.error("cannot listen: %s", error)
            await asyncio.gather(*(pod.stop() for pod in pods))
            return 1
        last = args.base_port + len(pods) - 1
        ports = str(args.base_port) if len(pods) == 1 else f"{args.base_port}-{last}"
        adapters = ", ".join(args.lora) or "none"
        log.info(
            "ready: %d simulated pod(s) of %s on %s:%s (adapters: %s; time scale %g; "
            "metrics %s)",
            len(pods), args.model, args.host, ports, adapters, args.time_scale,
            args.metrics_format,
        )
        await stop.wait()
        await asyncio.gather(*(pod.stop() for pod in pods))
        log.info("stopped")
        return 0

    return run_service(main)
