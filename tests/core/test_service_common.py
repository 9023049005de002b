"""Shared HTTP behaviour: validation 422 naming the field, 413, auth 401/403, 404, no 500 traces."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel, Field

from mempo.metrics import Metrics
from mempo.service import AdminDep, Forbidden, Overloaded, inside_root, install_common
from mempo.settings import ServiceSettings


class Body(BaseModel):
    queries: list[str] = Field(min_length=1)


def make_app(token: str | None = "s3cret", ready: bool = True, admin_open: bool = False) -> FastAPI:
    app = FastAPI()

    async def is_ready() -> tuple[bool, str | None]:
        return ready, None if ready else "index loading"

    settings = ServiceSettings(max_body_bytes=2048, admin_token=token, admin_open=admin_open)  # type: ignore[arg-type]
    install_common(app, "demo", Metrics("demo"), is_ready, settings)

    @app.post("/echo")
    async def echo(body: Body) -> Body:
        return body

    @app.post("/admin")
    async def admin(_: AdminDep) -> dict[str, bool]:
        return {"ok": True}

    @app.get("/busy")
    async def busy() -> None:
        raise Overloaded("queue full", retry_after=2.4)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret internals")

    return app


@pytest.fixture
async def client() -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=make_app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        yield c  # type: ignore[misc]


async def test_validation_names_the_field(client: httpx.AsyncClient) -> None:
    r = await client.post("/echo", json={"queries": []})
    assert r.status_code == 422 and r.json()["message"].startswith("queries:")
    r = await client.post("/echo", json={"queries": "x"})
    assert r.status_code == 422 and "queries" in r.json()["message"]
    r = await client.post("/echo", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422


async def test_body_limit(client: httpx.AsyncClient) -> None:
    r = await client.post("/echo", json={"queries": ["x" * 5000]})
    assert r.status_code == 413 and "2048 bytes" in r.json()["message"]


async def test_admin_auth(client: httpx.AsyncClient) -> None:
    assert (await client.post("/admin")).status_code == 401
    assert (await client.post("/admin", headers={"Authorization": "Bearer wrong"})).status_code == 403
    assert (await client.post("/admin", headers={"Authorization": "Basic s3cret"})).status_code == 401
    assert (await client.post("/admin", headers={"Authorization": "Bearer s3cret"})).json() == {"ok": True}


async def test_closed_without_token_unless_opened_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    transport = httpx.ASGITransport(app=make_app(token=None))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        closed = await c.post("/admin", headers={"Authorization": "Bearer anything"})
        assert closed.status_code == 403 and "closed" in closed.json()["message"]
    assert "OPEN" not in caplog.text
    transport = httpx.ASGITransport(app=make_app(token=None, admin_open=True))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        assert (await c.post("/admin")).status_code == 200
    assert "admin routes are OPEN" in caplog.text
    transport = httpx.ASGITransport(app=make_app(admin_open=True))  # a token wins over the opt-in
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        assert (await c.post("/admin")).status_code == 401


async def test_ops_routes(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).json() == {"status": "ok", "service": "demo"}
    assert (await client.get("/ready")).json()["ready"] is True
    await client.post("/echo", json={"queries": ["a"]})
    metrics = (await client.get("/metrics")).text
    assert 'mempo_demo_requests_total{code="200",route="/echo"} 1.0' in metrics
    assert (await client.get("/nope")).status_code == 404
    busy = await client.get("/busy")
    assert busy.status_code == 503 and busy.headers["retry-after"] == "2"


async def test_not_ready() -> None:
    transport = httpx.ASGITransport(app=make_app(ready=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.get("/ready")
        assert r.status_code == 503 and r.json()["reason"] == "index loading"


async def test_unexpected_error_has_no_trace(client: httpx.AsyncClient) -> None:
    r = await client.get("/boom")
    assert r.status_code == 500 and r.json() == {"message": "internal error: RuntimeError", "detail": None}


def test_inside_root(tmp_path: Path) -> None:
    (tmp_path / "v1").mkdir()
    assert inside_root(str(tmp_path / "v1"), tmp_path) == (tmp_path / "v1").resolve()
    with pytest.raises(Forbidden):
        inside_root(str(tmp_path / ".." / "elsewhere"), tmp_path)
    with pytest.raises(Forbidden):
        inside_root("/etc", tmp_path)
    with pytest.raises(Forbidden, match="no weights root"):  # no root: every update refused
        inside_root("/etc", None)


def test_a_variable_that_names_no_setting_is_reported_with_the_closest_name() -> None:
    from mempo.settings import unknown_variables
    from services.learner.settings import LearnerSettings

    environ = {
        "MEMPO_LEARNER_DRAIN_S": "5",  # renamed DRAIN_TIMEOUT_S
        "MEMPO_LEARNER_BATCH_GROUPS": "2",
        "MEMPO_LEARNER_TRAINER__LR": "1e-3",
        "MEMPO_LEARNER_FROBNICATE": "1",
        "MEMPO_SCORER_PORT": "1",  # another service's
    }
    assert unknown_variables(LearnerSettings(), environ) == [
        "MEMPO_LEARNER_DRAIN_S (did you mean MEMPO_LEARNER_DRAIN_TIMEOUT_S?)",
        "MEMPO_LEARNER_FROBNICATE",
    ]


# --------------------------------------------------------------------------- options


def test_every_plain_setting_is_an_option_over_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mempo.options import settings_from_args
    from services.scorer.settings import ScorerSettings

    monkeypatch.setenv("MEMPO_SCORER_PORT", "9001")
    monkeypatch.setenv("MEMPO_SCORER_DEVICE", "cpu")
    settings = settings_from_args(ScorerSettings, ["--port=9002", "--max-batch-share", "0.5"], "p")
    assert (settings.port, settings.max_batch_share, settings.device) == (9002, 0.5, "cpu")
    with pytest.raises(SystemExit) as exited:
        settings_from_args(ScorerSettings, ["--help"], "mempo scorer serve")
    shown = capsys.readouterr().out
    assert exited.value.code == 0 and "--model-path" in shown and "MEMPO_SCORER_<NAME>" in shown
    assert "--admin-token" not in shown  # secrets only from the environment (ps shows argv)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prot", "1"], "No such option '--prot'"),
        (["--port", "x"], "port: Input should be a valid integer"),
    ],
)
def test_a_bad_option_exits_2_naming_it(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from mempo.options import settings_from_args
    from services.rollout.engine.settings import EngineSettings

    with pytest.raises(SystemExit) as exited:
        settings_from_args(EngineSettings, args, "mempo rollout engine")
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_a_password_in_a_url_option_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """`--redis-url redis://:pw@host` once worked, the password on the command line."""
    from mempo.options import settings_from_args
    from services.rollout.settings import WorkerSettings

    with pytest.raises(SystemExit) as exited:
        settings_from_args(WorkerSettings, ["--redis-url", "redis://:s3cret-password-0123@r:6379/0"], "w")
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--redis-url" in err and "MEMPO_ROLLOUT_REDIS_URL" in err
    assert "s3cret" not in err
    url = "redis://r:6379/0"  # without a password: fine
    assert settings_from_args(WorkerSettings, ["--redis-url", url], "w").redis_url == url


def test_an_alias_and_the_nested_trainer_block_stays_off_the_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mempo.options import settings_from_args
    from services.learner.settings import LearnerSettings
    from services.retrieval.settings import RetrievalSettings

    assert settings_from_args(
        RetrievalSettings, ["--index", "/x"], "r", {"index": "index_path"}
    ).index_path
    with pytest.raises(SystemExit):
        settings_from_args(LearnerSettings, ["--help"], "mempo learner serve")
    shown = capsys.readouterr().out
    assert "--total-steps" in shown and "--questions-per-task" in shown and "--trainer" not in shown
