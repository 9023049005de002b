"""Serve a CPU engine over real HTTP from a background thread (tests, demos, benchmarks).

    with EngineThread(EngineSettings(port=free_port())) as url:
        ...  # talk to url with EngineClient

The server has its own event loop, so callers in any loop (or none) can use it.
"""

from __future__ import annotations

import threading
import time

import uvicorn

from mempo.httpserver import guarded_protocol, install_accept_error_filter
from mempo.procs import free_port, wait_ready
from services.rollout.engine.app import create_app
from services.rollout.engine.settings import EngineSettings


class EngineThread:
    def __init__(self, settings: EngineSettings, startup_timeout_s: float = 120.0) -> None:
        if settings.port == 0:
            settings = settings.model_copy(update={"port": free_port()})
        self.settings = settings
        self.startup_timeout_s = startup_timeout_s
        self.url = f"http://{settings.host}:{settings.port}"
        config = uvicorn.Config(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            log_level="warning",
            access_log=False,
            lifespan="on",
            http=guarded_protocol(
                settings.request_read_timeout_s,
                settings.idle_connection_timeout_s,
                settings.max_connections,
            ),
        )
        install_accept_error_filter()
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="engine-http", daemon=True)

    def start(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the CPU engine did not start on {self.url}")
            time.sleep(0.02)
        wait_ready(self.url, timeout_s=self.startup_timeout_s, path="/health")
        return self.url

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=60)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
