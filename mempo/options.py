"""Command lines made from settings: every plain field of a settings class (or of a
command's options model) is an option, with its docstring as help and its default shown;
a bad value exits 2 naming the option (``mempo <service> serve``, ``mempo up``,
``mempo sft``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import UnionType
from typing import Any, TypeVar, Union, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

from mempo.settings import fail

S = TypeVar("S", bound=BaseSettings)
# A typer command whose options are its settings' (settings_from_args reads ctx.args).
SETTINGS_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def settings_from_args(
    cls: type[S], args: Sequence[str], prog: str, aliases: Mapping[str, str] | None = None
) -> S:
    """``cls`` read from the environment, with ``args`` over it: every plain setting is an
    option (``--model-path x``, ``--model-path=x``); secrets and nested blocks (the
    learner's trainer) come from the environment only. ``--help`` lists them with their
    docstrings; ``aliases`` adds option names (``{"index": "index_path"}``). An unknown
    option or a bad value exits 2 with a message naming it."""
    extra = dict(aliases or {})
    params = [
        field_option(name, field, field.default, [a for a, to in extra.items() if to == name])
        for name, field in cls.model_fields.items()
        if on_command_line(field.annotation)
    ]
    env = str(cls.model_config.get("env_prefix", ""))
    given = read_options(
        prog, params, args, f"Every option is also the variable {env}<NAME>; options win."
    )
    refuse_url_passwords(given, env)
    return validated(lambda: cls(**given), lambda where: where)


def field_option(
    dest: str, field: FieldInfo, default: Any, aliases: Sequence[str] = (), flag: bool = False
) -> Any:
    """The click option ``--<dest with dashes>`` (and ``aliases``) of a setting: its
    docstring's first paragraph and ``default`` as help; a value not given reads None.
    ``flag``: a boolean as ``--x/--no-x`` rather than ``--x true``."""
    import click

    text = (field.description or "").split("\n\n")[0] + _default(default)
    option = dest.replace("_", "-")
    if flag:
        return click.Option([dest, f"--{option}/--no-{option}"], default=None, help=text)
    decls = [f"--{name.replace('_', '-')}" for name in (dest, *aliases)]
    return click.Option([dest, *decls], help=text, metavar=_metavar(field.annotation))


def command_options(model: type[BaseModel], exclude: Sequence[str] = ()) -> list[Any]:
    """A command's options made from ``model``'s plain fields (not ``exclude``): help from
    each docstring, the field's default, booleans as ``--x/--no-x``."""
    return [
        field_option(name, field, field.default, flag=field.annotation is bool)
        for name, field in model.model_fields.items()
        if name not in exclude and on_command_line(field.annotation)
    ]


def read_options(prog: str, params: list[Any], args: Sequence[str], epilog: str) -> dict[str, Any]:
    """The options given in ``args`` (none given: absent). ``--help`` prints every option and
    exits 0; an unknown option or a missing value exits 2 with click's message."""
    import click

    command = click.Command(prog, params=params, help=epilog)
    try:
        with command.make_context(prog, list(args)) as ctx:
            return {name: value for name, value in ctx.params.items() if value is not None}
    except click.exceptions.Exit as exc:  # --help
        raise SystemExit(exc.exit_code) from None
    except click.ClickException as exc:  # an unknown option, a missing value
        exc.show()
        raise SystemExit(2) from None


def refuse_url_passwords(given: Mapping[str, Any], env_prefix: str) -> None:
    """Exit 2 when an option's URL holds a password (ps shows every command line)."""
    for name, value in given.items():
        if "://" in str(value) and urlsplit(str(value)).password:
            fail(
                f"--{name.replace('_', '-')}: a password in a URL option shows on the command line "
                f"to every process of the machine; give it in {env_prefix}{name.upper()} or "
                f"{env_prefix}REDIS_PASSWORD"
            )


M = TypeVar("M", bound=BaseModel)


def validated(build: Callable[[], M], option: Callable[[str], str]) -> M:
    """``build()``; a bad value exits 2 naming it, ``option`` turning the setting's dotted
    path (``trainer.lr``) into what the user typed."""
    from pydantic import ValidationError

    try:
        return build()
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(map(str, err["loc"])) or "settings"
        fail(f"{option(where)}: {err['msg']}")
        raise  # fail() exits


def _default(value: Any) -> str:
    if isinstance(value, list):
        value = ",".join(map(str, value))
    return "" if value is None or value is PydanticUndefined else f"  [default: {value}]"


def _metavar(annotation: Any) -> str:
    union = get_origin(annotation) in (Union, UnionType)
    kinds = set(get_args(annotation) if union else (annotation,)) - {type(None)}
    names = {int: "INTEGER", float: "FLOAT", bool: "BOOLEAN"}
    return names.get(next(iter(kinds)), "TEXT") if len(kinds) == 1 else "TEXT"


def on_command_line(annotation: Any) -> bool:
    """Not a secret (it would show in ps) and not a nested block."""
    kinds = get_args(annotation) or (annotation,)
    return not any(
        kind is SecretStr or (isinstance(kind, type) and issubclass(kind, BaseModel))
        for kind in kinds
    )
