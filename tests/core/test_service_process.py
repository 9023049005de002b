"""The shared HTTP behaviour under a real uvicorn process, over one raw keep-alive socket:
an unexpected error is one logged traceback and a JSON 500 that leaves the connection
usable, and a chunked body over the limit (no Content-Length) is a 413 like any other."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mempo.procs import free_port, wait_ready

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """``make_app`` of test_service_common (body limit 2048 bytes) served by uvicorn."""
    port = free_port()
    log_path = tmp_path / "demo.log"
    args = [sys.executable, "-m", "uvicorn", "--factory", "tests.core.test_service_common:make_app"]
    args += ["--host", "127.0.0.1", "--port", str(port), "--no-access-log"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout_s=30, proc=proc)
        yield port, log_path
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def exchange(sock: socket.socket, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send one HTTP/1.1 request and read its response (Content-Length framed)."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    length = int(headers["content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection mid-body")
        body += chunk
    return int(lines[0].split()[1]), headers, body[:length]


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: demo\r\n\r\n".encode()


def test_a_500_keeps_the_connection_and_logs_one_traceback(demo: tuple[int, Path]) -> None:
    port, log_path = demo
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        status, headers, body = exchange(sock, get("/boom"))
        assert status == 500 and headers["content-type"] == "application/json"
        assert json.loads(body) == {"message": "internal error: RuntimeError", "detail": None}
        assert headers.get("connection", "").lower() != "close"
        status, _, body = exchange(sock, get("/health"))  # the same connection
        assert status == 200 and json.loads(body)["status"] == "ok"
        status, _, body = exchange(sock, get("/metrics"))
        assert 'mempo_demo_requests_total{code="500",route="/boom"} 1.0' in body.decode()
    log = log_path.read_text()
    assert log.count("Traceback (most recent call last)") == 1, log
    assert "secret internals" in log  # the log has it; the response did not


def test_an_oversized_chunked_body_is_413(demo: tuple[int, Path]) -> None:
    port, _ = demo
    payload = json.dumps({"queries": ["x" * 1000] * 4}).encode()  # about 4 KB > 2048
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(payload[i : i + 512]), payload[i : i + 512])
        for i in range(0, len(payload), 512)
    )
    request = (
        b"POST /echo HTTP/1.1\r\nHost: demo\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        status, _, body = exchange(sock, request)
    assert status == 413, body
    assert json.loads(body)["message"] == "request body exceeds the limit of 2048 bytes"


def test_free_port_never_hands_out_a_port_twice() -> None:
    """The kernel draws bind(0) ports at random from about 28 000: over 1000 draws a repeat
    is all but certain (a launch once gave its scorer and an engine one port)."""
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)
