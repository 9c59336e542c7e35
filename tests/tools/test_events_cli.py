"""``hma-redis events`` as operators run it: a process that publishes until SIGTERM (exit 0),
whose logs never carry the password, and whose bad options are one error line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess

import pytest
import redis
from vllm.distributed.kv_events import BlockStored

from hma_redis.tools.devkit.local_redis import LocalRedis, free_port
from tests.support.cli_run import Run, cli_command, run_script
from tests.support.kv_subscriber import KVSubscriber, wait_connected

SECRET = "s3cret-events-pw"


def test_the_command_publishes_until_sigterm_and_never_logs_the_password() -> None:
    server = LocalRedis().start()
    redis.Redis(port=server.port).config_set("requirepass", SECRET)
    sub = KVSubscriber()
    client = redis.Redis(port=server.port, password=SECRET)
    proc = subprocess.Popen(
        [
            *cli_command(),
            "events",
            "--url",
            f"redis://127.0.0.1:{server.port}/0",
            "--endpoint",
            sub.endpoint,
            "--replay-endpoint",
            f"tcp://127.0.0.1:{free_port()}",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HMA_REDIS_PASSWORD": SECRET},
    )
    try:
        wait_connected(client, sub)  # ~ vLLM's import time, then the first probe heard
        client.set("hma:ns1:g0:" + "ab" * 32, b"v")
        sub.wait_for(
            "the store",
            lambda: any(
                isinstance(e, BlockStored) and e.ownership == "hma_redis:ns1" for e in sub.events()
            ),
        )
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        sub.close()
        client.close()
        server.stop()
    assert proc.returncode == 0, err[-2000:]
    assert "subscribed to 1 node(s)" in err
    assert SECRET not in out + err


def test_an_endpoint_in_use_is_one_error_line(redis_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        endpoint = f"tcp://*:{taken.getsockname()[1]}"
        run = run_script("--url", redis_url, "events", "--endpoint", endpoint)
    assert run.err.startswith("hma-redis") and run.err.count("\n") == 1, run.err
    assert f"cannot publish on {endpoint}" in run.err
    assert run.code == 2


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--endpoint", "bogus://nowhere"], "not a tcp://, ipc:// or inproc:// endpoint"),
        (["--namespace", "no spaces"], "namespace"),
        (["--buffer-steps", "0"], "--buffer-steps"),
    ],
)
def test_bad_options_are_one_error_line(args: list[str], needle: str, redis_url: str) -> None:
    run: Run = run_script("--url", redis_url, "events", *args)
    assert run.err.startswith("hma-redis") and run.err.count("\n") == 1, run.err
    assert "Traceback" not in run.err + run.out
    assert needle in run.err
    assert run.code == 2
