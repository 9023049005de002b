"""Local processes: free ports, a private redis-server, waiting for readiness.

Used by ``mempo up`` and by the tests that run real servers.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import quote

import httpx

_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A loopback port free now and never handed out before by this process.

    The kernel may give the same ephemeral port to two binds in a row once the first socket
    is closed; two services of one launch were once given one port (the second failed to
    bind, and its clients reached the first), so ports handed out are remembered."""
    with _handed_out_lock:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def wait_ready(
    url: str,
    timeout_s: float = 60.0,
    path: str = "/ready",
    proc: subprocess.Popen[bytes] | None = None,
) -> None:
    """Poll ``url + path`` until it answers 200; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"{url}: the process exited with code {proc.returncode} before it was ready"
            )
        try:
            response = httpx.get(url.rstrip("/") + path, timeout=2.0)
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}: {response.text[:200]}"
        except httpx.HTTPError as exc:
            last = type(exc).__name__
        time.sleep(0.1)
    raise TimeoutError(f"{url}{path} not ready after {timeout_s:.0f}s ({last})")


class RedisServer:
    """A private redis-server on a free loopback port, in its own directory."""

    def __init__(
        self,
        directory: Path,
        port: int | None = None,
        appendonly: bool = False,
        password: str | None = None,
    ) -> None:
        self.directory = Path(directory).resolve()  # redis chdirs to --dir before --logfile
        self.port = port or free_port()  # kept across stop and start
        self.appendonly = appendonly
        self.password = password  # requirepass (fed on stdin, never on the command line)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's URL, password URL-quoted (any character survives the round trip)."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not on PATH: run scripts/bootstrap (or apt-get install redis-server)"
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            binary,
            "-",  # the rest of the configuration (the password) comes on stdin, not in ps
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--dir",
            str(self.directory),
            "--logfile",
            str(self.directory / "redis.log"),
            "--protected-mode",
            "yes",
        ]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        assert self.proc.stdin is not None
        config = f"requirepass {config_quote(self.password)}\n" if self.password else ""
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.write(config.encode())
            self.proc.stdin.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.proc.returncode}; see {self.directory / 'redis.log'}"
                )
            if self.ping() == b"+PONG":
                return self
            time.sleep(0.05)
        raise TimeoutError(f"redis-server did not answer on port {self.port}")

    def ping(self, password: str | None = None) -> bytes:
        """The first reply line of PING after AUTH with ``password`` (default: the
        server's; ``""``: no AUTH); b"" when nothing answers."""
        password = self.password if password is None else password
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as sock:
                if password:
                    sock.sendall(resp_command("AUTH", password))
                    sock.recv(256)
                sock.sendall(resp_command("PING"))
                return sock.recv(256).split(b"\r\n")[0]
        except OSError:
            return b""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def config_quote(value: str) -> str:
    """A redis.conf argument holding ``value`` exactly (double quotes, escapes)."""
    if any(c in value for c in "\r\n\0"):
        raise ValueError("a Redis password cannot hold a line break or a NUL")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def resp_command(*parts: str) -> bytes:
    """One command in RESP (arguments may hold spaces and any other character)."""
    encoded = [part.encode() for part in parts]
    return b"*%d\r\n" % len(encoded) + b"".join(b"$%d\r\n%s\r\n" % (len(e), e) for e in encoded)
