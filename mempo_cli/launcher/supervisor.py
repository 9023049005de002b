"""Child processes of ``mempo up``: started with their own log files, awaited until ready,
watched, and stopped cleanly (SIGTERM to each process group, then SIGKILL), so no orphan
processes or stale ports are left behind on completion, error or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType

import httpx

from mempo.settings import ServiceSettings, settings_env

log = logging.getLogger(__name__)


@dataclass
class Child:
    name: str
    url: str | None
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready_path: str = "/ready"
    argv: list[str] = field(default_factory=list)  # what ``restart`` runs again
    env: dict[str, str] = field(default_factory=dict, repr=False)  # holds secrets: never shown

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ChildFailed(RuntimeError):
    pass


@dataclass
class Supervisor:
    run_dir: Path
    children: list[Child] = field(default_factory=list)
    _previous_handlers: dict[int, object] = field(default_factory=dict)

    def start(
        self,
        name: str,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        url: str | None = None,
        ready_path: str = "/ready",
    ) -> Child:
        """Start ``python -m mempo_cli <args>`` (or any argv) with its output in logs/<name>.log."""
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{name}.log"
        argv = list(args)
        if argv and argv[0] == "mempo":
            argv = [sys.executable, "-m", "mempo_cli", *argv[1:]]
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = _spawn(argv, child_env, log_path)
        child = Child(name, url, proc, log_path, ready_path, argv, child_env)
        self.children.append(child)
        log.info("started %s (pid %d), log %s", name, child.proc.pid, log_path)
        return child

    def start_service(
        self, name: str, command: str, settings: ServiceSettings, env: dict[str, str] | None = None
    ) -> Child:
        """``mempo <command>`` (``"scorer serve"``) with ``settings`` as its environment
        (``mempo.settings.settings_env``) over ``env``, ready at its port on loopback."""
        env = {**(env or {}), **settings_env(settings)}
        return self.start(
            name, ["mempo", *command.split()], env, f"http://127.0.0.1:{settings.port}"
        )

    def restart(self, child: Child, timeout_s: float = 15.0) -> Child:
        """Stop ``child`` if it still runs, then start it again: same command, environment
        and log file (appended to). The ``Child`` object is kept, with its new process."""
        self.stop(child, timeout_s)
        child.proc = _spawn(child.argv, child.env, child.log_path)
        log.info("restarted %s (pid %d)", child.name, child.proc.pid)
        return child

    def kill(self, child: Child, sig: signal.Signals = signal.SIGKILL) -> None:
        """Send ``sig`` to the child's whole process group (SIGKILL: a crash; SIGSTOP /
        SIGCONT: freeze and thaw it)."""
        _signal_group(child.proc, sig)
        if sig == signal.SIGKILL:
            child.proc.wait(timeout=10)

    def wait_ready(self, children: Sequence[Child], timeout_s: float = 180.0) -> None:
        """Poll every child's readiness route; fail with its log tail if it dies or times out."""
        pending = [c for c in children if c.url]
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as http:
            while pending:
                for child in list(pending):
                    if not child.alive():
                        raise ChildFailed(
                            f"{child.name} exited with code {child.proc.returncode} before it was ready; "
                            f"last log lines:\n{child.log_tail()}"
                        )
                    try:
                        if http.get(f"{child.url}{child.ready_path}").status_code == 200:
                            pending.remove(child)
                    except httpx.HTTPError:
                        pass
                if pending and time.monotonic() > deadline:
                    names = ", ".join(c.name for c in pending)
                    raise ChildFailed(
                        f"not ready after {timeout_s:.0f}s: {names} (logs in {self.run_dir / 'logs'})"
                    )
                if pending:
                    time.sleep(0.2)

    def check(self) -> None:
        """Raise if any child died."""
        for child in self.children:
            if not child.alive():
                raise ChildFailed(
                    f"{child.name} exited with code {child.proc.returncode}; last log lines:\n{child.log_tail()}"
                )

    def stop(self, child: Child, timeout_s: float = 15.0) -> None:
        if child.alive():
            _signal_group(child.proc, signal.SIGTERM)
            _signal_group(child.proc, signal.SIGCONT)  # a frozen (SIGSTOP) child acts on it now
            try:
                child.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs: killing it", child.name, timeout_s)
        _signal_group(child.proc, signal.SIGKILL)  # whatever is left of its process group
        if child.proc.poll() is None:
            child.proc.wait(timeout=5)

    def stop_all(self, timeout_s: float = 15.0) -> None:
        """Stop in reverse start order (the learner first, redis last)."""
        for child in reversed(self.children):
            self.stop(child, timeout_s)

    def __enter__(self) -> Supervisor:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A second Ctrl-C or SIGTERM while stopping must not cut stop_all short (it would
        # leave the remaining children running, orphaned): ignored until every child is down.
        self._previous_handlers.setdefault(signal.SIGINT, signal.getsignal(signal.SIGINT))
        for stopping in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(stopping, self._while_stopping)
        try:
            self.stop_all()
        finally:
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def _while_stopping(self, signum: int, frame: FrameType | None) -> None:
        log.warning("signal %d while stopping the services: stopping them still", signum)


def _spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as handle:
        return subprocess.Popen(  # own session: signals reach the child's whole tree
            argv, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
