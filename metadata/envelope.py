"""The envelope every stored metadata value shares: ``MAGIC | msgpack map`` with a format version.

Pure (no I/O). :func:`open_envelope` does the checks every decoder starts with — size bound before
parsing, magic, msgpack, a map, a supported ``format_version``, the required fields' types — and
raises `MetadataFormatError` naming the key and ``who`` (e.g. ``ledger 7``, ``log 'orders'``).
:func:`copy_with` makes a changed copy of a decoded value (a frozen dataclass) for its ``with_*``
helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgpack

from metadata.errors import MetadataFormatError


def open_envelope(
    data: bytes,
    *,
    key: str,
    who: str,
    what: str,
    magic: bytes,
    bytes_max: int,
    format_version_max: int,
    field_types: Mapping[str, type | tuple[type, ...]],
) -> dict[str, Any]:
    """The map inside ``data``, checked; ``what`` names the kind of value (``ledger metadata``)."""
    if len(data) > bytes_max:
        raise MetadataFormatError(key, f"{who}: value of {len(data)} bytes exceeds {bytes_max}")
    if not data.startswith(magic):
        raise MetadataFormatError(key, f"{who}: not {what} (bad magic {data[:4]!r})")
    try:
        body = msgpack.unpackb(data[len(magic) :], raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as error:
        raise MetadataFormatError(key, f"{who}: corrupt msgpack: {error}") from error
    if not isinstance(body, dict):
        raise MetadataFormatError(key, f"{who}: expected a map, got {type(body).__name__}")
    version = body.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= format_version_max:
        raise MetadataFormatError(
            key, f"{who}: unsupported format_version {version!r} (max {format_version_max})"
        )
    for name, expected in field_types.items():
        if name not in body:  # before the type: a field that may be nil is still required
            raise MetadataFormatError(key, f"{who}: field {name!r} missing")
        if not isinstance(body[name], expected):
            raise MetadataFormatError(key, f"{who}: field {name!r} of wrong type")
    return body


def unpack_map(key: str, data: bytes, *, bytes_max: int, format_version_max: int) -> dict[str, Any]:
    """The checks of a plain msgpack map value (no magic): size bound before parsing, msgpack, a
    map, a supported ``format_version``; `MetadataFormatError` naming ``key`` otherwise."""
    if len(data) > bytes_max:
        raise MetadataFormatError(key, f"value of {len(data)} bytes exceeds {bytes_max}")
    try:
        body = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException) as error:
        raise MetadataFormatError(key, f"corrupt msgpack: {error}") from error
    if not isinstance(body, dict):
        raise MetadataFormatError(key, f"expected a map, got {type(body).__name__}")
    version = body.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= format_version_max:
        raise MetadataFormatError(key, f"unsupported format_version {version!r} (max {format_version_max})")
    return body


_Value = TypeVar("_Value")


def copy_with(
    value: _Value,
    names: tuple[str, ...],
    changes: Mapping[str, Any],
    normalize: Mapping[str, Callable[[Any], Any]],
) -> _Value:
    """``dataclasses.replace(value, **changes)`` without its generic machinery (no ``__init__``, no
    ``__post_init__``): the fields ``names`` not changed are taken as they are (``value``'s are
    normalized already), a changed one goes through its ``normalize`` function if it has one. The
    caller validates the copy."""
    new = object.__new__(type(value))
    for name in names:
        object.__setattr__(new, name, getattr(value, name))
    for name, changed in changes.items():
        fix = normalize.get(name)
        object.__setattr__(new, name, changed if fix is None else fix(changed))
    return new
