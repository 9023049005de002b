"""docs/configuration.md, generated from the settings classes: ``mempo docs config [--check]``.

Every service reads its settings from environment variables through a pydantic-settings
class with a docstring on each field (``use_attribute_docstrings=True`` puts it in
``FieldInfo.description``). ``render()`` turns those classes into one markdown page: a
table per class with the variable, its type and constraints, its default and the
docstring. The output depends only on the classes, never on this machine: defaults that
are computed at start-up (the worker id) are described, not evaluated.

The settings modules are imported inside ``render()``, so ``mempo --help`` stays quick.
"""

from __future__ import annotations

import difflib
import enum
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


@dataclass(frozen=True)
class Section:
    """One settings class and how its variables are named."""

    title: str
    target: str  # "module:Class"
    env_prefix: str  # "MEMPO_SCORER_", or "MEMPO_LEARNER_TRAINER__" for the nested trainer
    intro: str


SHARED = Section(
    "Shared by every service",
    "mempo.settings:ServiceSettings",
    "MEMPO_<SERVICE>_",
    "Every service class below inherits these fields (`<SERVICE>` is `RETRIEVAL`, "
    "`SCORER`, `ROLLOUT`, `ENGINE` or `LEARNER`); a class may override a default, as its "
    "own table shows. The admin token only guards routes that exist: the scorer's "
    "`/update_weights_from_disk` and the CPU engine's weight update, cache flush, pause, "
    "continue and abort routes. Retrieval, the rollout worker and "
    "the learner have no admin routes, so their `ADMIN_TOKEN` protects nothing (the "
    "learner uses its own as the default of `ENGINE_ADMIN_TOKEN`).",
)

SECTIONS = [
    Section(
        "Retrieval",
        "services.retrieval.settings:RetrievalSettings",
        "MEMPO_RETRIEVAL_",
        "`mempo retrieval serve` (`--index` is `--index-path`). "
        "See [retrieval.md](retrieval.md).",
    ),
    Section(
        "Scorer",
        "services.scorer.settings:ScorerSettings",
        "MEMPO_SCORER_",
        "`mempo scorer serve`. See [scorer.md](scorer.md).",
    ),
    Section(
        "Rollout worker",
        "services.rollout.settings:WorkerSettings",
        "MEMPO_ROLLOUT_",
        "`mempo rollout worker`, and the worker half of `services/rollout/entrypoint.sh`. "
        "See [rollout.md](rollout.md).",
    ),
    Section(
        "CPU engine",
        "services.rollout.engine.settings:EngineSettings",
        "MEMPO_ENGINE_",
        "`mempo rollout engine`: the CPU engine that speaks SGLang's HTTP API. A GPU "
        "replica runs SGLang instead, configured by its own flags (`MODEL`, `SGLANG_ARGS` "
        "in the entrypoint), not by these variables.",
    ),
    Section(
        "Learner",
        "services.learner.settings:LearnerSettings",
        "MEMPO_LEARNER_",
        "`mempo learner serve`. See [learner.md](learner.md).",
    ),
    Section(
        "Learner: the PPO trainer",
        "services.learner.trainer_config:TrainerConfig",
        "MEMPO_LEARNER_TRAINER__",
        "The `trainer` field of the learner, one variable per field with a double "
        "underscore (`MEMPO_LEARNER_TRAINER__LR=1e-6`), or all at once as JSON "
        '(`MEMPO_LEARNER_TRAINER=\'{"lr": 1e-6, "row_tokens": null}\'`), which is the only '
        "way to set a field to null from the environment. See [trainer.md](trainer.md).",
    ),
]

# Defaults computed at start-up: described, never evaluated (they name this machine).
COMPUTED_DEFAULTS = {
    ("WorkerSettings", "worker_id"): "hostname-pid",
}

# Variables read outside the settings classes: (name, where, meaning).
OTHER_VARIABLES = [
    ("MEMPO_REDIS_URL", "`mempo up`",
     "use this Redis instead of starting a private redis-server; keys get the prefix "
     "`mempo:<run name>:`"),
    ("MEMPO_CACHE", "every service, `mempo up`",
     "where the tiny model is built on first use, and `mempo up` caches its SFT warm "
     "start (default `~/.cache/mempo`)"),
    ("HF_HUB_OFFLINE", "every service",
     "set to `1` unless already set: nothing is ever downloaded from a model hub"),
    ("ENGINE", "services/rollout/entrypoint.sh",
     "`sglang` (GPU image), `cpu` (the CPU engine) or `external` (worker only)"),
    ("MODEL", "services/rollout/entrypoint.sh", "model folder the replica's engine starts on"),
    ("ENGINE_PORT", "services/rollout/entrypoint.sh", "the replica's engine port (30000)"),
    ("SGLANG_ARGS", "services/rollout/entrypoint.sh",
     "extra `sglang.launch_server` flags, e.g. `--context-length 8192 --mem-fraction-static 0.8`"),
    ("ENGINE_WAIT_S", "services/rollout/entrypoint.sh",
     "how long the worker waits for the engine's `/health` (1800)"),
    ("WORLD_SIZE, RANK, LOCAL_RANK", "the learner under torchrun",
     "set by torchrun; rank 0 serves HTTP and talks to Redis"),
]


def render() -> str:
    """The whole of docs/configuration.md."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by `mempo docs config` from the settings classes "
        "(mempo_cli/docs_config.py); do not edit by hand. -->",
        "",
        "Every setting is an environment variable: the service's prefix plus the field name "
        "in capitals (`MEMPO_SCORER_MAX_QUEUE=512`). Names are case-insensitive. Booleans "
        "take `true`/`false`; lists and tuples take JSON (`[0.9, 0.95]`), except the "
        'learner\'s `QUESTIONS_PER_TASK` (`2`, `1,2,4` or `1-3`). "unset" means the field is '
        "null unless the variable is given; the value `null` unsets an optional setting. An "
        "empty value is not unset: it is the empty string (an error for a number). A value "
        "outside its range stops the service at start-up with a message naming the field.",
        "",
        "`PRESET` (the learner and the rollout worker) names a recipe whose values lie under "
        "every value given, by option or variable: `tiny` is the tiny model's, the one "
        "`mempo up` runs and whose values its `--help` shows as defaults (each service's "
        "`PRESETS` in its settings.py).",
        "",
        "`mempo up` and `mempo eval` build each child's settings object in the parent and "
        "hand it over as that child's environment (`mempo.settings.settings_env`, one "
        "variable per setting, the inverse of reading them), so a launched service reads "
        "exactly the settings the launcher built; a `MEMPO_<SERVICE>_<NAME>` variable in the "
        "launcher's environment is read there like in the service.",
        "",
        "Every setting that is not a secret or a nested block is also an option of the "
        "service's command, which wins over the variable (`mempo scorer serve --max-queue 512`; "
        "`--help` lists them; mempo.options.settings_from_args).",
        "",
        "For the docker compose deployment, `.env` variables and what they feed are in "
        "[operations.md](operations.md).",
        "",
    ]
    for section in [SHARED, *SECTIONS]:
        lines += _section(section)
    lines += _other_variables()
    return "\n".join(lines).rstrip() + "\n"


def settings_classes() -> dict[str, type[BaseModel]]:
    """Section title -> the class it documents."""
    return {s.title: _load(s.target) for s in [SHARED, *SECTIONS]}


def env_name(prefix: str, field_name: str) -> str:
    return f"{prefix}{field_name.upper()}"


def _section(section: Section) -> list[str]:
    cls = _load(section.target)
    lines = [f"## {section.title}", "", f"`{section.target.replace(':', '.')}`. {section.intro}", ""]
    lines += ["| variable | type | default | description |", "|---|---|---|---|"]
    for name, info in cls.model_fields.items():  # inherited fields too: every variable listed
        variable = env_name(section.env_prefix, name)
        default = _default(cls, name, info)
        lines.append(
            f"| `{variable}` | {_cell(_type(info))} | {_cell(default)} | {_cell(_text(info))} |"
        )
    return [*lines, ""]


def _load(target: str) -> type[BaseModel]:
    """The settings class a section names (imported here: the learner's pulls in torch)."""
    from mempo.settings import ServiceSettings
    from services.learner.settings import LearnerSettings
    from services.learner.trainer_config import TrainerConfig
    from services.retrieval.settings import RetrievalSettings
    from services.rollout.engine.settings import EngineSettings
    from services.rollout.settings import WorkerSettings
    from services.scorer.settings import ScorerSettings

    classes: dict[str, type[BaseModel]] = {
        f"{cls.__module__}:{cls.__name__}": cls
        for cls in (ServiceSettings, RetrievalSettings, ScorerSettings, WorkerSettings,
                    EngineSettings, LearnerSettings, TrainerConfig)
    }  # fmt: skip
    return classes[target]


# ----------------------------------------------------------------- cells


def _text(info: FieldInfo) -> str:
    description = " ".join((info.description or "").split())
    return description.replace("``", "`")


def _type(info: FieldInfo) -> str:
    text = _type_name(info.annotation)
    bounds = _bounds(info)
    return f"{text}, {bounds}" if bounds else text


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{v}`" for v in args)
    if origin in (list, tuple, dict, set):
        inner = ", ".join(_type_name(a) for a in args if a is not Ellipsis)
        return f"{origin.__name__}[{inner}]"
    if isinstance(annotation, type):
        if issubclass(annotation, SecretStr):
            return "secret"
        if issubclass(annotation, Path):
            return "path"
        if issubclass(annotation, BaseModel):
            return "object (below)"
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _bounds(info: FieldInfo) -> str:
    """Range constraints as text: "0..65535", ">= 1", "> 0, <= 1"."""
    found: dict[str, Any] = {}
    for meta in info.metadata:
        for key in ("ge", "gt", "le", "lt"):
            if getattr(meta, key, None) is not None:
                found[key] = getattr(meta, key)
    if set(found) == {"ge", "le"}:
        return f"{_value(found['ge'])}..{_value(found['le'])}"
    signs = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return ", ".join(f"{signs[k]} {_value(found[k])}" for k in signs if k in found)


def _default(cls: type[BaseModel], name: str, info: FieldInfo) -> str:
    computed = COMPUTED_DEFAULTS.get((cls.__name__, name))
    if computed is not None:
        return computed
    if info.default is PydanticUndefined and info.default_factory is None:
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "see below"
    if value is None:
        return "unset"
    text = f"`{_value(value)}`" if _value(value) != "" else '`""` (empty)'
    if name.endswith("_bytes") and isinstance(value, int) and value >= 1 << 20:
        text += f" ({value / (1 << 20):g} MiB)"
    return text


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, Path):
        return value.as_posix()
    if isinstance(value, list):
        return ",".join(_value(v) for v in value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


_CODE = re.compile(r"(`[^`]*`)")
_TAG_START = re.compile(r"<(?=[A-Za-z/!?])")  # what markdown would read as an HTML tag


def _cell(text: str) -> str:
    """A markdown-safe table cell: pipes escaped; outside code spans, a "<" that would
    open an HTML tag (``<mem>``, ``<hostname>``) too."""
    parts = _CODE.split(text)
    for i in range(0, len(parts), 2):
        parts[i] = _TAG_START.sub(r"\\<", parts[i])
    return "".join(parts).replace("|", r"\|")


def _other_variables() -> list[str]:
    lines = [
        "## Other environment variables",
        "",
        "Read outside the settings classes.",
        "",
        "| variable | read by | meaning |",
        "|---|---|---|",
    ]
    for name, where, meaning in OTHER_VARIABLES:
        names = ", ".join(f"`{n.strip()}`" for n in name.split(","))
        lines.append(f"| {names} | {_cell(where)} | {_cell(meaning)} |")
    return [*lines, ""]


# ----------------------------------------------------------------- CLI

app = typer.Typer(help="Generated documentation.", no_args_is_help=True)


@app.callback()
def docs_group() -> None:
    """Generated documentation."""


@app.command("config")
def config_command(
    check: Annotated[
        bool, typer.Option("--check", help="exit 1 if the file is out of date; write nothing")
    ] = False,
    out: Annotated[Path, typer.Option(help="the page to write or check")] = DOC_PATH,
) -> None:
    """Write docs/configuration.md from the settings classes (or --check it)."""
    text = render()
    current = out.read_text(encoding="utf-8") if out.exists() else ""
    if check:
        if not out.exists():
            typer.echo(f"{out} does not exist: run `mempo docs config`", err=True)
            raise typer.Exit(1)
        if current == text:
            typer.echo(f"{out} is up to date")
            return
        diff = difflib.unified_diff(
            current.splitlines(), text.splitlines(), str(out), "render()", lineterm="", n=1
        )
        typer.echo("\n".join(list(diff)[:40]), err=True)
        typer.echo(f"{out} is out of date: run `mempo docs config`", err=True)
        raise typer.Exit(1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    typer.echo(f"wrote {out}")
