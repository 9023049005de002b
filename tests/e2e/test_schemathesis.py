"""Schemathesis against every service's OpenAPI: no input gives a server error.

Five real processes (retrieval, scorer, CPU engine, an HTTP-only rollout worker on that
engine, retrieval and scorer, and the learner on a real redis-server), each with an admin
token. Every operation of every service's ``/openapi.json`` gets four passes (``PASSES``):

- bounded: schema-valid requests (positive mode) with the admin token, so admin bodies
  are parsed, validated and acted on;
- guided: the same with request fields narrowed to what the services' own rules accept
  (and weight folders inside the weights root), so the cases run the whole route; every
  guided operation must succeed at least once;
- negative: schema-violating requests, on the schema as served;
- no token: admin operations without the token, which must all be 401;

and every answer must be below 500. The rollout worker may answer 502 / 503 (an upstream
failed, or it is not ready) and the learner 503: those say whose fault it is.

Bounded in time: examples per operation are capped, hypothesis is derandomized (the same
cases every run) with no deadline and no example database, and the positive schemas cap
the sizes that cost CPU time (group size, rounds, new tokens, list lengths), so a case is
a fraction of a second on the tiny model.
"""

from __future__ import annotations

import copy
import re
import secrets
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import Case, GenerationMode
from schemathesis.core.result import Err

from mempo_cli.launcher.supervisor import Supervisor
from tests.e2e.live_services import SERVICES, HttpStack, start_http_stack

pytestmark = pytest.mark.e2e

TOKEN = secrets.token_hex(16)
# Caps of the positive schemas: the properties whose size is CPU time on the tiny model.
CAPS = {"n": 3, "max_rounds": 3, "max_new_tokens": 64}
MAX_ITEMS = 6
WORD = {"type": "string", "pattern": "^[A-Za-z][A-Za-z ]{0,24}$"}
ALIASES = {"type": "array", "minItems": 1, "maxItems": 3, "items": WORD}
ONE_WORD, ONE_ALIAS_LIST = (
    {"type": "array", "minItems": 1, "maxItems": 1, "items": item} for item in (WORD, ALIASES)
)
# The guided pass: request fields narrowed to what the services' own rules accept (equal
# numbers of questions and alias lists, non-blank aliases, token ids inside the tiny
# vocabulary, one of text / input_ids, no streaming), so most cases run the whole route.
GUIDES: dict[str, dict[str, Any]] = {
    "GenerateRequest": {
        "text": {"type": "null"},
        "stream": {"enum": [False]},
        "input_ids": {"type": "array", "minItems": 1, "maxItems": 24,
                      "items": {"type": "integer", "minimum": 0, "maximum": 2047}},
    },
    "MemoryTrajectory": {"questions": ONE_WORD, "answers": ONE_ALIAS_LIST},
    "ScoreItem": {"answers": ALIASES},
    "Task": {"questions": ONE_WORD, "answers": ONE_ALIAS_LIST, "schema_version": {"enum": [1]}},
}  # fmt: skip
# The worker forwards a weight update only with the version it is told to track.
GUIDED_REQUIRED = {
    "GenerateRequest": ["input_ids"],
    "UpdateWeightsFromDiskRequest": ["model_path", "weight_version"],
}
# The weight broadcast's routes need a learner joining the same group to succeed.
BROADCAST_ROUTES = {"/init_weights_update_group", "/update_weights_from_distributed",
                    "/destroy_weights_update_group"}
# Statuses that are not a server fault: the worker's upstream failed or it is not ready.
UPSTREAM = {"worker": {502, 503}, "learner": {503}}
ADMIN = {
    "engine": {
        "/update_weights_from_disk", "/flush_cache", "/pause_generation",
        "/continue_generation", "/abort_request", *BROADCAST_ROUTES,
    },
    "scorer": {"/update_weights_from_disk"},
    "worker": {"/update_weights_from_disk", "/pause_generation", "/continue_generation", *BROADCAST_ROUTES},
}  # fmt: skip


@dataclass(frozen=True)
class Pass:
    name: str
    schema: str  # "bounded" | "guided" | "served"
    mode: GenerationMode
    examples: int
    token: bool
    which: str  # "all" | "body" (operations with a request body) | "admin"


PASSES = [
    Pass("bounded", "bounded", GenerationMode.POSITIVE, 20, token=True, which="all"),
    Pass("guided", "guided", GenerationMode.POSITIVE, 20, token=True, which="body"),
    Pass("negative", "served", GenerationMode.NEGATIVE, 15, token=True, which="body"),
    Pass("no token", "bounded", GenerationMode.POSITIVE, 5, token=False, which="admin"),
]


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, redis_url: str
) -> Iterator[HttpStack]:
    run = tmp_path_factory.mktemp("schemathesis")
    shutil.copytree(tiny_model_dir, run / "weights" / "v1")  # a folder weight updates can load
    with Supervisor(run) as sup:
        yield start_http_stack(
            sup, run, tiny_model_dir, redis_url, TOKEN, prefix=f"fuzz-{uuid.uuid4().hex[:8]}:"
        )


def bounded(raw: dict[str, Any]) -> dict[str, Any]:
    """A copy of the OpenAPI document whose expensive sizes are capped (``CAPS``,
    ``MAX_ITEMS``); everything else, types and validation rules, is as served."""
    doc = copy.deepcopy(raw)

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
            return
        if not isinstance(node, dict):
            return
        if node.get("type") == "array":
            node["maxItems"] = min(node.get("maxItems", MAX_ITEMS), MAX_ITEMS)
        for name, cap in CAPS.items():
            prop = node.get("properties", {}).get(name)
            if isinstance(prop, dict) and prop.get("type") == "integer":
                prop["maximum"] = min(prop.get("maximum", cap), cap)
        for value in node.values():
            walk(value)

    walk(doc.get("components", {}))
    walk(doc.get("paths", {}))
    return doc


def guided(raw: dict[str, Any], weights_root: Path) -> dict[str, Any]:
    """``bounded(raw)`` with the ``GUIDES`` fields replaced, and weight folders drawn from
    inside the weights root: v1/ (loadable), ``..``, other names, names longer than the
    file system allows, each maybe with a sub-path."""
    doc = bounded(raw)
    components = doc.get("components", {}).get("schemas", {})
    root = re.escape(str(weights_root))
    model_path = {
        "type": "string",
        "pattern": rf"^{root}/(v1|\.\.|[a-z0-9.]{{1,12}}|[a-z]{{256,300}})(/[a-z.]{{1,4}})?$",
    }
    guides = {**GUIDES, "UpdateWeightsFromDiskRequest": {"model_path": model_path}}
    for name, fields in guides.items():
        if name in components:
            components[name]["properties"].update(fields)
            components[name]["required"] = GUIDED_REQUIRED.get(
                name, components[name].get("required", [])
            )
    return doc


def operations(doc: dict[str, Any]) -> dict[tuple[str, str], schemathesis.APIOperation]:
    schema = schemathesis.openapi.from_dict(doc)
    found = {}
    for result in schema.get_all_operations():
        if isinstance(result, Err):  # the service serves a schema that does not parse
            raise result.err()
        operation = result.ok()
        found[(operation.method.upper(), operation.path)] = operation
    return found


def explore(
    operation: schemathesis.APIOperation,
    mode: GenerationMode,
    examples: int,
    check: Callable[[Case], None],
) -> str | None:
    """Run ``check`` on generated cases; the minimal failing case's message, or None."""

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Case) -> None:
        check(case)

    try:
        run()
    except AssertionError as exc:
        return f"{operation.method.upper()} {operation.path} ({mode.value}): {exc}"
    return None


def make_check(
    service: str, url: str, headers: dict[str, str], seen: list[int], expect: int | None = None
) -> Callable[[Case], None]:
    """Every answer below 500 (or an allowed upstream status); exactly ``expect`` if set.
    The statuses go to ``seen``."""
    allowed = UPSTREAM.get(service, set())

    def check(case: Case) -> None:
        request = f"request: {case.method} {case.path} body={str(case.body)[:600]}"
        try:
            response = case.call(base_url=url, headers=headers, timeout=60)
        except requests.RequestException as exc:  # a hang or a dropped connection
            raise AssertionError(f"{type(exc).__name__}: {exc}\n{request}") from None
        if case.operation.path == "/pause_generation" and response.status_code == 200:
            resume(url)  # a paused engine holds every later /generate
        status = response.status_code
        seen.append(status)
        assert status < 500 or status in allowed, f"HTTP {status}: {response.text[:400]}\n{request}"
        assert expect is None or status == expect, f"HTTP {status}, not {expect}\n{request}"

    return check


def resume(url: str) -> None:
    reply = httpx.post(f"{url}/continue_generation", headers=bearer(TOKEN), timeout=30)
    assert reply.status_code == 200, reply.text


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize("service", SERVICES)
def test_no_input_gives_a_server_error(stack: HttpStack, service: str) -> None:
    url = stack.urls[service]
    raw = httpx.get(f"{url}/openapi.json", timeout=10).raise_for_status().json()
    schemas = {"bounded": operations(bounded(raw)),
               "guided": operations(guided(raw, stack.weights_root)),
               "served": operations(raw)}  # fmt: skip
    admin = ADMIN.get(service, set())
    assert {path for _, path in schemas["served"]} >= admin, "an admin route is not in the OpenAPI"
    # Admin operations last: pausing, aborting and loading weights act on the engine.
    order = sorted(schemas["served"], key=lambda key: (key[1] in admin, key))
    failures: list[str | None] = []
    seen: dict[tuple[str, str, str], list[int]] = {}
    for key in order:
        for run in PASSES:
            operation = schemas[run.schema][key]
            if (run.which == "body" and not operation.body) or (
                run.which == "admin" and key[1] not in admin
            ):
                continue
            headers = bearer(TOKEN) if run.token else {}
            statuses = seen.setdefault((run.name, *key), [])
            check = make_check(service, url, headers, statuses, None if run.token else 401)
            failures.append(explore(operation, run.mode, run.examples, check))
    if service == "engine":
        resume(url)
    assert not [f for f in failures if f], "\n\n".join(f for f in failures if f)
    assert all(seen[("bounded", *key)] for key in order), f"an operation was never called: {seen}"
    for (name, _, path), statuses in seen.items():  # the guided cases ran the whole route
        # UNFINISHED: the worker's forwarded weight update (issue 13.7) is not yet guided to
        # a version and folder its engine accepts; its refusals are still checked above.
        if (name, path) == ("guided", "/update_weights_from_disk") and service == "worker":
            continue
        if path in BROADCAST_ROUTES:  # succeed only with a learner in the group (tests/e2e/test_broadcast.py)
            continue
        assert name != "guided" or 200 in statuses, f"guided {path} never succeeded: {statuses}"
    assert httpx.get(f"{url}/ready", timeout=10).status_code == 200, "the service did not survive"
    assert stack.children[service].alive()
