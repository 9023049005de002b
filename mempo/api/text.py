"""Strings on the wire are valid Unicode.

JSON can spell a lone UTF-16 surrogate (``"\\ud800"``); Python decodes it into a ``str``
that no tokenizer and no UTF-8 encoder accepts, so it would fail deep inside a service
(a 500). ``Text`` refuses it at validation: a 422 naming the field. ``ALL_TEXT`` checks
every string inside a union field (``str | list[str]``) after it is validated, so the
error names the field itself rather than each branch pydantic tried.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel


def valid_unicode(value: str) -> str:
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"not valid Unicode: a lone surrogate {value[exc.start]!r} at character "
                f"{exc.start}"
            ) from None
    return value


def _check_tree(value: Any, where: str = "") -> None:
    try:
        if isinstance(value, str):
            valid_unicode(value)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}" if where else str(exc)) from None
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_tree(item, f"{where}[{i}]")
    elif isinstance(value, BaseModel):
        for name, item in value:
            _check_tree(item, f"{where}.{name}" if where else name)


def _all_text(value: Any) -> Any:
    _check_tree(value)
    return value


Text = Annotated[str, AfterValidator(valid_unicode)]
ALL_TEXT = AfterValidator(_all_text)
