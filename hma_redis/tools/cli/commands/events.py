"""``hma-redis events``: publish every store and removal of the tier's chunks in this Redis
deployment as vLLM KV events (ZMQ), for cache-aware routers; runs until SIGTERM / Ctrl-C.

The publisher lives in :mod:`hma_redis.tools.events` and needs vLLM; it is imported only when
this command runs, so the other commands work without it. docs/events.md says what a
subscriber receives.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from typing import Any

from hma_redis.tools.cli.admin import RedisAdmin
from hma_redis.tools.cli.options import checked_namespace, positive
from hma_redis.tools.cli.output import EXIT_OK, EXIT_USAGE, CliError

NAME = "events"
HELP = "publish the tier's stores and removals as vLLM KV events (ZMQ) for routers"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ZMQ endpoints, the replay buffer, the topic, the scope and the view."""
    parser.add_argument(
        "--endpoint",
        type=_endpoint,
        default="tcp://*:5557",
        help="ZMQ PUB endpoint: bound when it has a wildcard (tcp://*:PORT) or is ipc:// / "
        "inproc://, else connected to (a subscriber that binds), as vLLM's publisher does "
        "(default: tcp://*:5557)",
    )
    parser.add_argument(
        "--replay-endpoint",
        type=_endpoint_or_off,
        default="tcp://*:5558",
        help="ZMQ ROUTER endpoint for replay requests, or 'off' (default: tcp://*:5558)",
    )
    parser.add_argument(
        "--buffer-steps",
        type=positive,
        default=10_000,
        help="batches kept for replay (default: 10000)",
    )
    parser.add_argument("--topic", default="", help="ZMQ topic of every message (default: '')")
    parser.add_argument("--namespace", help="only this namespace (default: every one)")
    parser.add_argument(
        "--view",
        choices=("groups", "usable"),
        default="groups",
        help="groups: one event per KV-cache group (group_idx set); usable: only chunks every "
        "group holds (group_idx null) (default: groups)",
    )
    parser.add_argument(
        "--hash-format",
        choices=("int", "bytes"),
        default="int",
        help="block hashes as vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 gives them (int: "
        "the low 64 bits) or =0 (bytes) (default: int)",
    )


def run(admin: RedisAdmin, args: argparse.Namespace) -> int:
    """Publish until SIGTERM or Ctrl-C; exit 0. vLLM missing, or an endpoint that cannot be
    bound, is one error line (exit 2)."""
    namespace = checked_namespace(admin, args.namespace)
    # vLLM logs its platform probing at import (Triton, ...): only its errors reach stderr,
    # unless the operator asks for more.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.disable(logging.WARNING)
    try:
        from hma_redis.tools.events.batches import View
        from hma_redis.tools.events.service import EventsOptions, EventsService
    except ImportError as exc:
        raise CliError(
            f"hma-redis events needs vLLM (pip install 'hma_redis[vllm]'): {exc}", EXIT_USAGE
        ) from None
    finally:
        logging.disable(logging.NOTSET)
    options = EventsOptions(
        endpoint=args.endpoint,
        replay_endpoint=None if args.replay_endpoint == "off" else args.replay_endpoint,
        buffer_steps=args.buffer_steps,
        topic=args.topic,
        namespace=namespace,
        view=View(args.view),
        int_hashes=args.hash_format == "int",
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        service = EventsService(admin.cfg, options)
    except Exception as exc:  # zmq.ZMQError and vLLM's ValueError: a bad endpoint
        raise CliError(f"cannot publish on {args.endpoint}: {exc}", EXIT_USAGE) from None
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, _setter(stop))
    try:
        service.run(stop)
    except KeyboardInterrupt:
        pass  # Ctrl-C: stop as SIGTERM does
    finally:
        signal.signal(signal.SIGTERM, previous)
        service.close()
    return EXIT_OK


_SCHEMES = ("tcp://", "ipc://", "inproc://")


def _endpoint(text: str) -> str:
    """An argument type: a ZMQ endpoint of a transport vLLM's publisher takes."""
    if not text.startswith(_SCHEMES) or len(text) <= len(text.split("://")[0]) + 3:
        raise argparse.ArgumentTypeError(f"not a tcp://, ipc:// or inproc:// endpoint: {text!r}")
    return text


def _endpoint_or_off(text: str) -> str:
    return text if text == "off" else _endpoint(text)


def _setter(stop: threading.Event) -> Any:
    def handler(signum: int, frame: object) -> None:
        stop.set()

    return handler
