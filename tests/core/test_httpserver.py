"""mempo.httpserver's log filter for asyncio's accept errors and its open-files limit."""

from __future__ import annotations

import asyncio
import logging
import re
import resource
import socket
import subprocess
import sys

import pytest

from mempo.httpserver import ACCEPT_ERROR, AcceptErrorFilter, install_accept_error_filter


def _accept_errors(
    loop: asyncio.AbstractEventLoop, count: int, tick: list[float], step: float
) -> None:
    """What asyncio's selector loop does on each accept() that fails with EMFILE."""
    with socket.socket() as sock:
        for _ in range(count):
            loop.call_exception_handler(
                {
                    "message": ACCEPT_ERROR,
                    "exception": OSError(24, "Too many open files"),
                    "socket": sock,
                }
            )
            tick[0] += step


def test_a_burst_of_accept_errors_logs_one_line_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """10,000 accept errors over 15 s: two records, the second counting those not logged;
    other asyncio records pass."""
    tick = [0.0]
    logger = logging.getLogger("asyncio")
    installed = [f for f in logger.filters if isinstance(f, AcceptErrorFilter)]  # by a server of an earlier test
    for f in installed:
        logger.removeFilter(f)
    accept_filter = AcceptErrorFilter(interval_s=10.0, clock=lambda: tick[0])
    logger.addFilter(accept_filter)
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.DEBUG, logger="asyncio"):
            _accept_errors(loop, 10_000, tick, 0.0015)
            logger.error("Task exception was never retrieved")
    finally:
        loop.close()
        logger.removeFilter(accept_filter)
        for f in installed:
            logger.addFilter(f)
    records = [r for r in caplog.records if r.name == "asyncio"]
    assert len(records) == 3
    first, second, other = (r.getMessage() for r in records)
    assert first.startswith(ACCEPT_ERROR) and "more like it" not in first
    held = re.search(r"\((\d+) more like it not logged since the last\)", second.splitlines()[0])
    assert held and int(held.group(1)) == 6666  # the records of 0.0015 .. 9.999 s
    assert records[0].exc_info is not None  # the one logged keeps its traceback
    assert other == "Task exception was never retrieved"


def test_installed_once_and_a_real_burst_is_one_line(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("asyncio")
    before = list(logger.filters)
    installed = install_accept_error_filter()
    try:
        assert install_accept_error_filter() is installed
        assert len(logger.filters) == len(before) + (installed not in before)
        loop = asyncio.new_event_loop()
        try:
            with caplog.at_level(logging.ERROR, logger="asyncio"):
                _accept_errors(loop, 10_000, [0.0], 0.0)
        finally:
            loop.close()
    finally:
        if installed not in before:
            logger.removeFilter(installed)
    assert len([r for r in caplog.records if r.name == "asyncio"]) <= 1


@pytest.mark.parametrize(
    ("limits", "expected"), [((512, 4096), (2048, 4096)), ((512, 512), (256, 512))]
)
def test_the_open_files_limit_is_raised_and_max_connections_fitted_under_it(
    limits: tuple[int, int], expected: tuple[int, int]
) -> None:
    code = (
        "import resource; from mempo.httpserver import fit_connection_limit; "
        "print(fit_connection_limit(2048), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limits),
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert tuple(int(x) for x in out.stdout.split()) == expected
    assert ("lowered to 256" in out.stderr) == (expected[0] < 2048), out.stderr
