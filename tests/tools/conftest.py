"""Fixtures the CLI's tests share."""

from __future__ import annotations

from typing import Any

import pytest

from hma_redis.tools.cli.main import main
from tests.support.cli_run import Run


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], redis_url: str) -> Any:
    """Run ``hma-redis --url <session redis> ARGS...`` in-process (``url=None``: no --url;
    another ``url``: that one)."""

    def run(*args: str, url: str | None = redis_url) -> Run:
        argv = (["--url", url] if url is not None else []) + list(args)
        code = main(argv)
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return run
