"""`mempo retrieval serve` as a real process with no configuration, called like Search-R1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from mempo.procs import free_port, wait_ready
from mempo_sim.world import World

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.e2e
def test_serves_search_r1_requests_with_zero_setup(world: World, tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMPO_RETRIEVAL_")}
    env.update(HF_HUB_OFFLINE="1", MEMPO_RETRIEVAL_PORT=str(port))
    log = (tmp_path / "retrieval.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mempo_cli", "retrieval", "serve"],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout_s=60, proc=proc)
        question = next(q for q in world.questions if len(q.relations) == 1)
        # What Search-R1's generation.py sends, with a plain synchronous client.
        payload = {"queries": [question.text, "born"], "topk": 3, "return_scores": True}
        result = httpx.post(f"{url}/retrieve", json=payload, timeout=10).json()["result"]
        assert [len(hits) for hits in result] == [3, 3]
        assert result[0][0]["document"]["contents"].startswith(f"{question.subject}\n")
        assert httpx.get(f"{url}/v1/info", timeout=10).json()["corpus_size"] == len(world.passages)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
        log.close()
    output = (tmp_path / "retrieval.log").read_text()
    # uvicorn shuts down gracefully, then re-raises SIGTERM: the exit status says so.
    assert code in (0, -signal.SIGTERM) and "Application shutdown complete" in output, output


def _status(sock: socket.socket) -> bytes:
    """Read one Content-Length framed response off ``sock``; its status line."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")))
    while len(rest) < length:
        rest += sock.recv(4096)
    return head.split(b"\r\n")[0]


def _closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closes ``sock`` (fails after ``seconds``)."""
    started = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - started


@pytest.mark.e2e
def test_half_sent_requests_are_cut_off_and_slow_whole_ones_are_not(tmp_path: Path) -> None:
    """The read timeout (1 s here) closes a request whose headers or body stop halfway, 40
    of them at once, and leaves alone a request sent slowly but whole within it."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMPO_RETRIEVAL_")}
    env.update(HF_HUB_OFFLINE="1", MEMPO_RETRIEVAL_PORT=str(port), MEMPO_RETRIEVAL_REQUEST_READ_TIMEOUT_S="1")
    log = (tmp_path / "retrieval.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mempo_cli", "retrieval", "serve"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    body = json.dumps({"queries": ["born"], "topk": 1}).encode()
    head = f"POST /retrieve HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    try:
        wait_ready(url, timeout_s=60, proc=proc)
        stalled = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        for i, sock in enumerate(stalled):  # half the headers, or the headers and half the body
            sock.sendall(head.encode()[:20] if i % 2 else head.encode() + body[:5])
        for sock in stalled:
            assert _closed_within(sock, 10) < 10
            sock.close()
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(head.encode())
            time.sleep(0.4)
            sock.sendall(body[:5])
            time.sleep(0.4)
            sock.sendall(body[5:])
            sock.settimeout(10)
            assert _status(sock) == b"HTTP/1.1 200 OK"
            time.sleep(1.5)  # kept alive past the read timeout: no request is under way
            sock.sendall(head.encode() + body)
            assert _status(sock) == b"HTTP/1.1 200 OK"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        log.close()
    assert "was not fully sent" in (tmp_path / "retrieval.log").read_text()


@contextmanager
def _retrieval(tmp_path: Path, **settings: str) -> Iterator[tuple[int, Path]]:
    """`mempo retrieval serve` with ``MEMPO_RETRIEVAL_<NAME>`` settings: its port and log."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMPO_RETRIEVAL_")}
    env.update({f"MEMPO_RETRIEVAL_{name}": value for name, value in settings.items()})
    env.update(HF_HUB_OFFLINE="1", MEMPO_RETRIEVAL_PORT=str(port))
    path = tmp_path / "retrieval.log"
    with path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mempo_cli", "retrieval", "serve"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_ready(f"http://127.0.0.1:{port}", timeout_s=60, proc=proc)
            yield port, path
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=20)


def _until_closed(sock: socket.socket, seconds: float) -> bytes:
    """All ``sock`` receives until the server closes it (fails after ``seconds``)."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


@pytest.mark.e2e
def test_a_connection_that_sends_nothing_is_closed(tmp_path: Path) -> None:
    """idle_connection_timeout_s (1 s here) closes 30 connections that send nothing, one
    log line for them all; one that sends its request 0.5 s after connecting is answered."""
    with _retrieval(tmp_path, IDLE_CONNECTION_TIMEOUT_S="1") as (port, log):
        started = time.monotonic()
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(30)]
        with socket.create_connection(("127.0.0.1", port)) as sock:
            time.sleep(0.5)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
            sock.settimeout(5)
            assert _status(sock) == b"HTTP/1.1 200 OK"
        for sock in silent:
            assert _until_closed(sock, 5) == b""  # closed, nothing said
            sock.close()
        assert 0.9 < time.monotonic() - started < 5
    assert log.read_text().count("it sent nothing 1s after it was accepted") == 1


@pytest.mark.e2e
def test_connections_beyond_max_connections_get_503_and_health_keeps_answering(
    tmp_path: Path,
) -> None:
    """With max_connections 50, 600 connections that send nothing: those beyond 50 get a
    503 at once and are closed, the rest are closed 3 s after they came (idle timeout),
    /health answers throughout on a connection made before, and the log stays short."""
    settings = {"MAX_CONNECTIONS": "50", "IDLE_CONNECTION_TIMEOUT_S": "3"}
    with _retrieval(tmp_path, **settings) as (port, log):
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=5) as client:
            assert client.get("/health").status_code == 200
            flood = []
            for i in range(600):
                flood.append(socket.create_connection(("127.0.0.1", port)))
                if i % 50 == 49:
                    assert client.get("/health").status_code == 200
            answers = [_until_closed(sock, 8) for sock in flood]
            assert client.get("/health").status_code == 200
        for sock in flood:
            sock.close()
        refused = [a for a in answers if a]
        assert len(refused) >= 550 and len(answers) - len(refused) <= 49  # one slot is /health's
        for answer in refused:
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503 ") and b"connection: close" in head.lower()
            assert b"50 connections open, its limit (max_connections)" in body
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # the slots are free again
    lines = log.read_text().splitlines()
    assert sum("refused a connection with 503" in line for line in lines) == 1, lines
    assert sum("it sent nothing" in line for line in lines) == 1, lines
    assert len(lines) < 20, lines
