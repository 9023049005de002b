"""Numeric array fields for the wire records: token ids and log-probs.

Token ids and log-probs are the bulk of every record. Holding them in numpy (not as
lists of Python objects) lets them travel as raw bytes and hands the learner its
tensors without a per-element conversion. Three encodings, all validated back:

- plain JSON lists (HTTP, ``model_dump_json()``);
- self-contained packed JSON, ``{"dtype": "<i4", "b64": "..."}``
  (``model_dump_json(context={"pack": True})``);
- JSON plus a binary sidecar (``dump_with_sidecar`` / ``load_with_sidecar``): each array
  is ``{"dtype": "<i4", "ref": [offset, count]}`` into one bytes blob, decoded as
  zero-copy numpy views. The Redis streams use this (benchmarks/queue_throughput.py).
"""

from __future__ import annotations

import binascii
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np
from pydantic import (
    BaseModel,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    SerializationInfo,
    ValidationInfo,
)
from pydantic_core import CoreSchema, core_schema


class PackedArray(Sequence[Any]):
    """An immutable 1-D numeric array; compares equal to a list with the same values."""

    __slots__ = ("_array",)
    dtype: ClassVar[str]
    kinds: ClassVar[str]  # numpy dtype kinds accepted on input
    json_item: ClassVar[dict[str, Any]]

    def __init__(self, values: Any = ()) -> None:
        array = np.asarray(values)
        if array.ndim != 1:
            raise ValueError(f"expected a flat list of numbers, got {array.ndim} dimensions")
        if array.size and array.dtype.kind not in self.kinds:
            raise ValueError(f"expected {self.json_item['type']} values, got {array.dtype.name}")
        self._check(array)
        array = array.astype(self.dtype, copy=False)
        array.setflags(write=False)
        self._array = array

    @classmethod
    def _check(cls, array: np.ndarray) -> None:
        """Range checks on the input values; raise ValueError naming the problem."""

    def numpy(self) -> np.ndarray:
        """The read-only numpy array (no copy)."""
        return self._array

    def tolist(self) -> list[Any]:
        return self._array.tolist()  # type: ignore[no-any-return]

    def __len__(self) -> int:
        return int(self._array.shape[0])

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return type(self)(self._array[index])
        return self._array[index].item()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._array.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedArray):
            return bool(np.array_equal(other.numpy(), self._array))
        if isinstance(other, (list, tuple, np.ndarray)):
            values = np.asarray(other)
            return values.shape == self._array.shape and bool(np.array_equal(values, self._array))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tolist()!r})"

    @classmethod
    def validate(cls, value: Any, info: ValidationInfo | None = None) -> PackedArray:
        if isinstance(value, cls):
            return value
        if isinstance(value, dict) and "ref" in value:
            sidecar = info.context.get("sidecar") if info is not None and isinstance(info.context, dict) else None
            return cls.from_sidecar(value, sidecar)
        if isinstance(value, dict):
            return cls.unpack(value)
        if isinstance(value, (list, tuple, np.ndarray)):
            if len(value) and any(
                isinstance(v, bool) or not isinstance(v, (int, float, np.number)) for v in value[:1]
            ):
                raise ValueError(f"expected a list of {cls.json_item['type']} values")
            return cls(value)
        raise ValueError(f"expected a list of {cls.json_item['type']} values")

    @classmethod
    def unpack(cls, value: dict[str, Any]) -> PackedArray:
        if set(value) != {"dtype", "b64"} or value["dtype"] != cls.dtype:
            raise ValueError(f'a packed array is {{"dtype": "{cls.dtype}", "b64": "..."}}')
        try:
            raw = binascii.a2b_base64(value["b64"], strict_mode=True)
            return cls(np.frombuffer(raw, dtype=cls.dtype))
        except (binascii.Error, TypeError) as exc:
            raise ValueError(f"packed array is not valid base64 of {cls.dtype}: {exc}") from exc

    @classmethod
    def from_sidecar(cls, value: dict[str, Any], sidecar: bytes | None) -> PackedArray:
        if sidecar is None:
            raise ValueError("a sidecar reference needs the binary sidecar (load_with_sidecar)")
        ref = value.get("ref")
        if value.get("dtype") != cls.dtype or not (
            isinstance(ref, list) and len(ref) == 2 and all(isinstance(x, int) and x >= 0 for x in ref)
        ):
            raise ValueError(f'a sidecar array is {{"dtype": "{cls.dtype}", "ref": [offset, count]}}')
        offset, count = ref
        itemsize = np.dtype(cls.dtype).itemsize
        if offset + count * itemsize > len(sidecar):
            raise ValueError(f"sidecar reference [{offset}, {count}] runs past the {len(sidecar)}-byte sidecar")
        # A zero-copy view, range-checked like any other input (vectorised, no copy):
        # anyone who can write to the stream can write a sidecar, and a NaN log-prob
        # that reached the learner would turn the whole policy into NaN.
        view = cls.__new__(cls)
        view._array = np.frombuffer(sidecar, dtype=cls.dtype, count=count, offset=offset)
        cls._check(view._array)
        return view

    def pack(self) -> dict[str, str]:
        return {
            "dtype": self.dtype,
            "b64": binascii.b2a_base64(self._array.tobytes(), newline=False).decode(),
        }

    def _serialize(self, info: SerializationInfo) -> Any:
        if info.mode_is_json() and isinstance(info.context, dict):
            sidecar = info.context.get("sidecar")
            if isinstance(sidecar, Sidecar):
                return {"dtype": self.dtype, "ref": [sidecar.add(self._array), len(self)]}
            if info.context.get("pack"):
                return self.pack()
        return self.tolist()

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.with_info_plain_validator_function(
            cls.validate,
            serialization=core_schema.plain_serializer_function_ser_schema(
                cls._serialize, info_arg=True, when_used="always"
            ),
        )

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> dict[str, Any]:
        return {"type": "array", "items": cls.json_item}


class TokenIds(PackedArray):
    """Token ids as int32 (every real vocabulary fits), each in [0, 2**31 - 1]."""

    dtype = "<i4"
    kinds = "iu"
    json_item: ClassVar[dict[str, Any]] = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}

    @classmethod
    def _check(cls, array: np.ndarray) -> None:
        if array.size and (array.min() < 0 or array.max() > 2**31 - 1):
            raise ValueError("token ids must lie in [0, 2**31 - 1]")


# The lowest log-prob a record may carry. A sampled token's log-prob is never near it (a
# token of probability e^-100 is never drawn), and it is far from where sums and
# differences of log-probs overflow a float (-1e308 made the learner's metrics null).
LOGPROB_FLOOR = -1e4


class LogProbs(PackedArray):
    """Log-probabilities as float64 (so packing is lossless), each in [LOGPROB_FLOOR, 0]."""

    dtype = "<f8"
    kinds = "iuf"
    json_item: ClassVar[dict[str, Any]] = {"type": "number", "minimum": LOGPROB_FLOOR, "maximum": 0}

    @classmethod
    def _check(cls, array: np.ndarray) -> None:
        if array.size and not (np.isfinite(array).all() and array.min() >= LOGPROB_FLOOR and array.max() <= 0.0):
            raise ValueError(f"log-probs must be finite and in [{LOGPROB_FLOOR:g}, 0]")


class Sidecar:
    """Collects array bytes during serialisation; offsets are 8-byte aligned."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, array: np.ndarray) -> int:
        pad = -self.size % 8
        if pad:
            self.parts.append(b"\0" * pad)
            self.size += pad
        offset = self.size
        raw = array.tobytes()
        self.parts.append(raw)
        self.size += len(raw)
        return offset

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


M = TypeVar("M", bound=BaseModel)


def dump_with_sidecar(model: BaseModel) -> tuple[str, bytes]:
    """(JSON with array references, the arrays' bytes)."""
    sidecar = Sidecar()
    text = model.model_dump_json(context={"sidecar": sidecar})
    return text, sidecar.getvalue()


def load_with_sidecar(cls: type[M], text: str | bytes, sidecar: bytes) -> M:
    """Inverse of dump_with_sidecar; the arrays are zero-copy views of ``sidecar``."""
    return cls.model_validate_json(text, context={"sidecar": sidecar})
