"""`mempo retrieval serve` as a real process with no configuration, called like Search-R1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
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
