"""Security: admin routes need the token, weights load only from the weights root.

In-process (each app's create_app + lifespan behind httpx.ASGITransport):
- the admin routes of every service are exactly the known ones, and every other route is
  on a public list, so a new route cannot slip in without a decision;
- every admin route answers 401 without a token (or with another scheme) and 403 with a
  wrong one (the CPU engine 401, as SGLang), and a refused call changes nothing; the
  right token works;
- a model_path outside the weights root (absolute, ``..``, a symlink, a sibling with the
  same prefix, ``~``) is 403 on the engine and the scorer, a path that cannot name a folder
  is 422 or 400, never a 500, and the weights stay as they were;
- public routes need no token.

No secret reaching a log, a file or a status page of a real run:
tests/e2e/test_secret_leaks.py.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute

from mempo.service import require_admin
from tests.e2e.live_services import refused

TOKEN = secrets.token_hex(16)
WRONG = secrets.token_hex(16)

# (method, path) -> a body that would act if the token were right.
ENGINE_ADMIN: dict[tuple[str, str], Any] = {
    ("POST", "/update_weights_from_disk"): "v1",  # filled with the weights root's v1
    ("POST", "/flush_cache"): None,
    ("GET", "/flush_cache"): None,
    ("POST", "/pause_generation"): {"mode": "in_place"},
    ("POST", "/continue_generation"): {},
    ("POST", "/abort_request"): {"abort_all": True},
}
# The weight broadcast's routes: refused like the others; with the token they need a
# learner joining the same group to succeed (tests/e2e/test_broadcast.py).
BROADCAST_ADMIN: dict[tuple[str, str], Any] = {
    ("POST", "/init_weights_update_group"): {
        "master_address": "127.0.0.1", "master_port": 9, "rank_offset": 1, "world_size": 2, "backend": "gloo",
    },
    ("POST", "/update_weights_from_distributed"): {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]},
    ("POST", "/destroy_weights_update_group"): {},
}  # fmt: skip
ENGINE_ADMIN.update(BROADCAST_ADMIN)
SCORER_ADMIN: dict[tuple[str, str], Any] = {("POST", "/update_weights_from_disk"): "v1"}
OPS = {("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics")}
PUBLIC = {
    "engine": OPS | {
        ("POST", "/generate"), ("PUT", "/generate"), ("GET", "/health_generate"),
        ("GET", "/model_info"), ("GET", "/get_model_info"),
        ("GET", "/server_info"), ("GET", "/get_server_info"),
    },
    "scorer": OPS | {("POST", "/v1/memory-scores"), ("POST", "/v1/score"), ("GET", "/model_info")},
    "retrieval": OPS | {("POST", "/retrieve"), ("GET", "/v1/info")},
    "worker": OPS | {("GET", "/v1/status"), ("POST", "/v1/episodes")},
    "learner": OPS | {("GET", "/v1/status")},
}  # fmt: skip
# forwarded to the replica's engine
WORKER_ADMIN = {("POST", "/update_weights_from_disk"), ("POST", "/pause_generation"),
                ("POST", "/continue_generation"), *BROADCAST_ADMIN}  # fmt: skip
ADMIN = {"engine": set(ENGINE_ADMIN), "scorer": set(SCORER_ADMIN), "worker": WORKER_ADMIN}


REFUSED = refused(TOKEN, WRONG)
RIGHT = {"Authorization": f"Bearer {TOKEN}"}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def weights(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A weights root with v1/ (the tiny model), and loadable copies just outside it."""
    base = tmp_path_factory.mktemp("security")
    root = base / "weights"
    shutil.copytree(tiny_model_dir, root / "v1")
    shutil.copytree(tiny_model_dir, base / "outside")
    shutil.copytree(tiny_model_dir, base / "weights-sibling" / "v1")  # same string prefix
    (root / "link").symlink_to(base / "outside", target_is_directory=True)
    (root / "file-links").mkdir()  # a folder inside the root whose files link outside it
    for item in (base / "outside").iterdir():
        (root / "file-links" / item.name).symlink_to(item)
    (root / "empty").mkdir()
    return SimpleNamespace(root=root, base=base)


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan running, behind an in-process client (500s stay answers)."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            await wait_ready(client)
            yield client


async def wait_ready(client: httpx.AsyncClient, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (reply := await client.get("/ready")).status_code != 200:
        assert time.monotonic() < deadline, f"not ready: {reply.text}"
        await asyncio.sleep(0.1)


def engine_app(model: Path, root: Path, token: str | None = TOKEN) -> FastAPI:
    from services.rollout.engine.app import create_app
    from services.rollout.engine.settings import EngineSettings

    return create_app(
        EngineSettings(
            model_path=str(model), weights_root=str(root), admin_token=token,  # type: ignore[arg-type]
            threads=1, drain_timeout_s=1.0,
        )
    )  # fmt: skip


def scorer_app(model: Path, root: Path, token: str | None = TOKEN) -> FastAPI:
    from services.scorer.app import create_app
    from services.scorer.settings import ScorerSettings

    return create_app(
        ScorerSettings(
            model_path=str(model), weights_root=str(root), admin_token=token,  # type: ignore[arg-type]
            device="cpu", max_wait_ms=1.0,
        )
    )  # fmt: skip


APPS: dict[str, Callable[..., FastAPI]] = {"engine": engine_app, "scorer": scorer_app}


def all_apps(model: Path, root: Path) -> dict[str, FastAPI]:
    """Every service's app, built but not started (routes only)."""
    from services.learner.app import create_app as learner
    from services.learner.settings import LearnerSettings
    from services.retrieval.app import create_app as retrieval
    from services.retrieval.settings import RetrievalSettings
    from services.rollout.app import create_app as worker
    from services.rollout.settings import WorkerSettings

    return {
        "engine": engine_app(model, root),
        "scorer": scorer_app(model, root),
        "retrieval": retrieval(RetrievalSettings(admin_token=TOKEN)),  # type: ignore[arg-type]
        "worker": worker(WorkerSettings(admin_token=TOKEN, redis_url="")),  # type: ignore[arg-type]
        "learner": learner(LearnerSettings(admin_token=TOKEN)),  # type: ignore[arg-type]
    }


def api_routes(
    routes: Iterable[Any], prefix: str = "", admin: bool = False
) -> Iterator[tuple[str, str, bool]]:
    """(method, path, needs the admin token) of every route, included routers' too
    (FastAPI >= 0.16x keeps an included router as one entry of ``app.routes``)."""
    for route in routes:
        if isinstance(route, APIRoute):
            for method in (route.methods or set()) - {"HEAD"}:
                yield method, prefix + route.path, admin or needs_admin(route)
        elif hasattr(route, "original_router"):
            context = getattr(route, "include_context", None)
            guarded = any(
                d.dependency is require_admin for d in getattr(context, "dependencies", [])
            )
            inner = prefix + getattr(context, "prefix", "")
            yield from api_routes(route.original_router.routes, inner, admin or guarded)


def needs_admin(route: APIRoute) -> bool:
    stack, seen = [route.dependant], False
    while stack:
        dependant = stack.pop()
        seen = seen or dependant.call is require_admin
        stack.extend(dependant.dependencies)
    return seen


async def call(
    client: httpx.AsyncClient, method: str, path: str, body: Any, headers: dict[str, str]
) -> httpx.Response:
    kwargs: dict[str, Any] = {"headers": headers}
    if method != "GET":
        kwargs["json"] = body if body is not None else {}
    return await client.request(method, path, **kwargs)


def resolved_body(body: Any, root: Path) -> Any:
    return {"model_path": str(root / body), "weight_version": "7"} if body == "v1" else body


# --------------------------------------------------------------------------- admin routes


def test_admin_routes_are_exactly_the_known_ones(tiny_model_dir: Path, tmp_path: Path) -> None:
    for service, app in all_apps(tiny_model_dir, tmp_path).items():
        routes = {(method, path): is_admin for method, path, is_admin in api_routes(app.routes)}
        admin = {key for key, is_admin in routes.items() if is_admin}
        assert admin == ADMIN.get(service, set()), f"{service}: admin routes {sorted(admin)}"
        unknown = set(routes) - admin - PUBLIC[service]
        assert not unknown, f"{service}: routes neither admin nor known public: {unknown}"
        assert PUBLIC[service] <= set(routes), f"{service}: {PUBLIC[service] - set(routes)}"


@pytest.mark.parametrize("service", ["engine", "scorer"])
async def test_admin_routes_refuse_missing_and_wrong_tokens(
    service: str, tiny_model_dir: Path, weights: SimpleNamespace
) -> None:
    routes = ENGINE_ADMIN if service == "engine" else SCORER_ADMIN
    async with serving(APPS[service](tiny_model_dir, weights.root)) as client:
        before = (await client.get("/model_info")).json()
        for (method, path), body in routes.items():
            for headers, status in REFUSED:
                reply = await call(client, method, path, resolved_body(body, weights.root), headers)
                want = 401 if service == "engine" else status  # SGLang: 401 for a wrong one
                assert reply.status_code == want, (method, path, headers, reply.text)
                assert TOKEN not in reply.text and WRONG not in reply.text
                if want == 401:
                    assert reply.headers.get("www-authenticate") == "Bearer"
        # Nothing a refused call asked for happened: same weights, not paused.
        assert (await client.get("/model_info")).json() == before
        assert (await client.get("/ready")).status_code == 200
        # The right token works, whatever the case of the scheme.
        for (method, path), body in routes.items():
            if (method, path) in BROADCAST_ADMIN:
                continue
            for scheme in ("Bearer", "bearer"):
                headers = {"Authorization": f"{scheme} {TOKEN}"}
                reply = await call(client, method, path, resolved_body(body, weights.root), headers)
                assert reply.status_code == 200, (method, path, reply.text)
                if path == "/pause_generation":
                    assert (await client.get("/ready")).status_code == 503  # it did pause
                    await call(client, "POST", "/continue_generation", {}, RIGHT)
        info = (await client.get("/model_info")).json()
        assert info["weight_version"] == "7" and info["model_path"] == str(weights.root / "v1")


@pytest.mark.parametrize("service", ["engine", "scorer"])
async def test_admin_routes_without_a_token_are_closed(
    service: str, tiny_model_dir: Path, weights: SimpleNamespace
) -> None:
    routes = ENGINE_ADMIN if service == "engine" else SCORER_ADMIN
    async with serving(APPS[service](tiny_model_dir, weights.root, token=None)) as client:
        before = (await client.get("/model_info")).json()
        for (method, path), body in routes.items():
            for headers in ({}, RIGHT, {"Authorization": "Bearer "}):
                reply = await call(client, method, path, resolved_body(body, weights.root), headers)
                assert reply.status_code == 403, (method, path, headers, reply.text)
                assert "admin routes are closed" in reply.text
        assert (await client.get("/model_info")).json() == before
        assert (await client.get("/ready")).status_code == 200


@pytest.mark.e2e
def test_an_engine_opened_for_development_says_so(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A real engine process: without a token its admin routes are closed; with
    ADMIN_OPEN=true they are open and its log says so at start."""
    from mempo.procs import free_port
    from mempo_cli.launcher.supervisor import Supervisor

    with Supervisor(tmp_path) as sup:
        for opened in (False, True):
            port = free_port()
            env = {"MEMPO_ENGINE_PORT": str(port), "MEMPO_ENGINE_MODEL_PATH": str(tiny_model_dir),
                   "MEMPO_ENGINE_THREADS": "1", "MEMPO_ENGINE_ADMIN_OPEN": str(opened).lower(),
                   "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
            child = sup.start(f"engine-{opened}", ["mempo", "rollout", "engine"],
                              url=f"http://127.0.0.1:{port}", env=env)  # fmt: skip
            sup.wait_ready([child], 120)
            reply = httpx.post(f"http://127.0.0.1:{port}/flush_cache", timeout=10)
            assert reply.status_code == (200 if opened else 403), reply.text
            assert ("admin routes are OPEN" in child.log_tail(200)) is opened
            sup.stop(child)


def outside_paths(weights: SimpleNamespace) -> list[str]:
    root: Path = weights.root
    return [
        str(weights.base / "outside"),
        f"{root}/../outside",
        str(root / "link"),  # a symlink inside the root to a folder outside it
        str(root / "file-links"),  # a folder inside whose files are symlinks to outside
        str(weights.base / "weights-sibling" / "v1"),
        "/",
        str(root.parent),
        "outside",  # relative: the process's working directory
        "~",
    ]


def invalid_paths(weights: SimpleNamespace) -> list[str]:
    root: Path = weights.root
    return [
        f"{root}/v1\x00",  # NUL: no file system path
        "~no-such-user-mempo/v1",  # a home directory that does not exist
        str(root / ("x" * 300)),  # a name longer than the file system allows
        str(root / "v1" / "config.json"),  # a file, not a folder
        str(root / "empty"),
        str(root / "missing"),
    ]


@pytest.mark.parametrize("service", ["engine", "scorer"])
async def test_weights_load_only_from_inside_the_root(
    service: str, tiny_model_dir: Path, weights: SimpleNamespace
) -> None:
    async with serving(APPS[service](tiny_model_dir, weights.root)) as client:
        before = (await client.get("/model_info")).json()
        for path in outside_paths(weights):
            body = {"model_path": path, "weight_version": "9"}
            reply = await client.post("/update_weights_from_disk", json=body, headers=RIGHT)
            assert reply.status_code == 403, (path, reply.text)
            assert "weights root" in reply.json()["message"]
        for path in invalid_paths(weights):
            body = {"model_path": path, "weight_version": "9"}
            reply = await client.post("/update_weights_from_disk", json=body, headers=RIGHT)
            assert reply.status_code in (400, 422), (path, reply.status_code, reply.text)
        assert (await client.get("/model_info")).json() == before  # nothing was loaded
        inside = {"model_path": f"{weights.root}/empty/../v1", "weight_version": "9"}
        reply = await client.post("/update_weights_from_disk", json=inside, headers=RIGHT)
        assert reply.status_code == 200 and reply.json()["success"] is True, reply.text
        assert (await client.get("/model_info")).json()["weight_version"] == "9"


# --------------------------------------------------------------------------- public routes


async def test_public_routes_need_no_token(tiny_model_dir: Path, tmp_path: Path) -> None:
    apps = all_apps(tiny_model_dir, tmp_path)
    calls: dict[str, list[tuple[str, str, Any]]] = {
        "engine": [
            ("POST", "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}),
            ("GET", "/health_generate", None), ("GET", "/model_info", None),
            ("GET", "/get_model_info", None), ("GET", "/server_info", None),
        ],
        "scorer": [
            ("POST", "/v1/score", {"items": [{"context": "Bothi was born in", "answers": ["Mirath"]}]}),
            ("POST", "/v1/memory-scores", {"questions": ["q?"], "answers": [["a"]],
                                           "rounds": [{"memory": "m", "transcript": "t"}]}),
            ("GET", "/model_info", None),
        ],
        "retrieval": [("POST", "/retrieve", {"queries": ["Bothi"]}), ("GET", "/v1/info", None)],
    }  # fmt: skip
    for service, requests in calls.items():
        async with serving(apps[service]) as client:
            for method, path, body in [*requests, *[(m, p, None) for m, p in sorted(OPS)]]:
                reply = await call(client, method, path, body, {})
                assert reply.status_code == 200, (service, method, path, reply.text)
