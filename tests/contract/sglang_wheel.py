"""SGLang's own request contract, read out of the pinned sglang wheel (this module holds
no tests).

scripts/fetch-sglang-contract (run by scripts/bootstrap) downloads the sglang wheel of
``SGLANG_VERSION`` without its dependencies into ``.venv/sglang-<version>/``. Nothing is
installed: the few modules that define the contract are executed straight from the wheel,
so no GPU stack is needed and ``import sglang`` still finds nothing.

- ``generate_contract_error``: ``sglang.srt.entrypoints.api_contract`` over
  ``sglang.api.v1.api_types``, the gate every /generate body passes on SGLang (400 when
  it returns a message);
- the request structs of the other routes (``sglang.srt.managers.io_struct``: only their
  class definitions, cut out of the module with ``ast``), validated as FastAPI does;
- which struct each route takes and its auth level, read from
  ``sglang/srt/entrypoints/http_server.py``.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from mempo.api.engine import SGLANG_VERSION

ROOT = Path(__file__).resolve().parents[2]
SIDE = ROOT / ".venv" / f"sglang-{SGLANG_VERSION}"
IO_STRUCTS = (
    "BaseReq",
    "PauseGenerationReqInput",
    "ContinueGenerationReqInput",
    "UpdateWeightFromDiskReqInput",
    "AbortReq",
    "InitWeightsUpdateGroupReqInput",
    "UpdateWeightsFromDistributedReqInput",
    "DestroyWeightsUpdateGroupReqInput",
)


@dataclass(frozen=True)
class Route:
    path: str
    body: str | None  # the io_struct class of its Body() parameter, None without one
    auth: str  # AuthLevel member name: NORMAL unless decorated


@dataclass(frozen=True)
class Contract:
    version: str
    generate_contract_error: Callable[[Any], str | None]
    sampling_fields: tuple[str, ...]
    structs: dict[str, type]  # io_struct class name -> the msgspec Struct
    routes: dict[str, Route]

    def fields(self, struct: str) -> set[str]:
        """The field names of an io_struct request struct."""
        import msgspec  # from the side folder when the venv has none

        return {f.name for f in msgspec.structs.fields(self.structs[struct])}

    def body_error(self, path: str, body: Any) -> str | None:
        """What SGLang's FastAPI route would refuse in ``body`` (None: accepted)."""
        from pydantic import TypeAdapter, ValidationError

        route = self.routes[path]
        if route.body is None:
            return None
        try:
            TypeAdapter(self.structs[route.body]).validate_python(body)
        except ValidationError as exc:
            return str(exc)
        return None


def wheel_path() -> Path:
    """The wheel, fetched now if missing; a skip only when PyPI cannot be reached (never
    under CI, where it must run)."""
    found = sorted(SIDE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not (SIDE / ".complete").exists() or not found:
        fetched = subprocess.run(
            [str(ROOT / "scripts" / "fetch-sglang-contract")], capture_output=True, text=True
        )
        found = sorted(SIDE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if fetched.returncode != 0 or not found:
            reason = f"sglang {SGLANG_VERSION} could not be fetched: {fetched.stderr[-400:]}"
            if os.environ.get("CI"):
                pytest.fail(reason)
            pytest.skip(reason)
    return found[-1]


def _module(name: str, source: str, where: str, namespace: dict[str, Any] | None = None) -> Any:
    """Execute ``source`` as module ``name`` (registered: msgspec resolves the string
    annotations of a Struct through its module); no parent package is imported."""
    module = ModuleType(name)
    module.__file__ = where
    module.__dict__.update(namespace or {})
    sys.modules[name] = module
    exec(compile(source, where, "exec"), module.__dict__)
    return module


def _classes(source: str, names: tuple[str, ...]) -> str:
    """The source of the named top-level classes, in file order; all must exist."""
    tree = ast.parse(source)
    found = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in names}
    missing = set(names) - set(found)
    assert not missing, f"io_struct.py no longer defines {sorted(missing)}"
    return "\n\n".join(ast.get_source_segment(source, found[n]) or "" for n in names)


def _routes(source: str) -> dict[str, Route]:
    """Route path -> its Body() struct and auth level, from http_server.py."""
    routes: dict[str, Route] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        paths, auth = [], "NORMAL"
        for deco in node.decorator_list:
            if not isinstance(deco, ast.Call) or not deco.args:
                continue
            name, arg = ast.unparse(deco.func), deco.args[0]
            if name.startswith("app.") and isinstance(arg, ast.Constant):
                paths.append(str(arg.value))
            elif name == "auth_level":
                auth = ast.unparse(arg).split(".")[-1]
        body = None
        for a in node.args.args:
            text = ast.unparse(a.annotation) if a.annotation is not None else ""
            if text.startswith("Annotated[") and "Body()" in text:
                body = text.removeprefix("Annotated[").split(",")[0].strip()
        routes.update({p: Route(p, body, auth) for p in paths})
    return routes


def load_contract() -> Contract:
    wheel = wheel_path()
    if importlib.util.find_spec("msgspec") is None:
        sys.path.append(str(SIDE / "site"))  # msgspec only; not sglang
    with zipfile.ZipFile(wheel) as z:

        def read(member: str) -> tuple[str, str]:
            return z.read(member).decode(), f"{wheel.name}/{member}"

        metadata = z.read(f"sglang-{SGLANG_VERSION}.dist-info/METADATA").decode()
        version = next(line.split(":", 1)[1].strip() for line in metadata.splitlines()
                       if line.startswith("Version:"))  # fmt: skip
        types_ = _module("sglang.api.v1.api_types", *read("sglang/api/v1/api_types.py"))
        gate = _module(
            "sglang.srt.entrypoints.api_contract", *read("sglang/srt/entrypoints/api_contract.py")
        )
        utils = _module(
            "sglang.srt.utils.msgspec_utils", *read("sglang/srt/utils/msgspec_utils.py")
        )
        io_source, io_where = read("sglang/srt/managers/io_struct.py")
        header = (
            "from __future__ import annotations\n"
            "from typing import Any, Dict, List, Literal, Optional, Union\n"
            "import msgspec\n\n"
        )
        namespace = {
            "msgspec_struct_pydantic_core_schema": utils.msgspec_struct_pydantic_core_schema,
            "FinishReasonDict": Any,  # response-side fields of AbortReq: any value
            "WeightVersionSpans": Any,
        }
        io = _module(
            "sglang.srt.managers.io_struct",
            header + _classes(io_source, IO_STRUCTS),
            io_where,
            namespace,
        )
        routes = _routes(read("sglang/srt/entrypoints/http_server.py")[0])
    return Contract(
        version=version,
        generate_contract_error=gate.generate_contract_error,
        sampling_fields=tuple(types_._FIELDS_SamplingParams),
        structs={name: getattr(io, name) for name in IO_STRUCTS},
        routes=routes,
    )
