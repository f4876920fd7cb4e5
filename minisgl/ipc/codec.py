"""The IPC codec: msgpack, with each message dataclass packed as an array: a small extension value
naming its class, then its field values in declaration order (compact, nested messages
round-trip, and one packer call does a whole message). Trailing fields still at their
defaults are left out (the constructor fills them in): most per-token outputs carry 5 of
their 17 fields, and a step sends one per running request.

`SamplingParams` travels the same way, but is rebuilt without running its validation again:
it was validated where it was built (see `checked_value`).
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import TypeVar

import msgpack

T = TypeVar("T")
_EXT_MESSAGE = 1
_REGISTRY: dict[str, type] = {}
_CHECKED: dict[str, _CheckedBuilder] = {}


def message(cls: type[T]) -> type[T]:
    """Register a dataclass so that it can be sent over IPC."""
    _REGISTRY[cls.__name__] = cls
    return cls


def checked_value(cls: type[T]) -> type[T]:
    """Register a dataclass that validates itself when built (in ``__post_init__``), such as
    `SamplingParams`: it was validated where it was made, so the receiver restores its fields
    as they were sent instead of calling the constructor (which would validate it again)."""
    message(cls)
    _CHECKED[cls.__name__] = _CheckedBuilder(cls)
    return cls


_NO_DEFAULT = object()

# A getter of a message's field values, each field's default, and the tag naming its class.
_Layout = tuple[Callable[[object], tuple[object, ...]], tuple[object, ...], msgpack.ExtType]
_LAYOUTS: dict[type, _Layout] = {}


def _layout(cls: type) -> _Layout:
    """A getter of the class's field values (one C call), each field's default, and the tag
    that names the class on the wire; built once per class."""
    layout = _LAYOUTS.get(cls)
    if layout is None:
        layout = _LAYOUTS[cls] = _make_layout(cls)
    return layout


def _make_layout(cls: type) -> _Layout:
    fs = fields(cls)
    getter: Callable[[object], tuple[object, ...]] = operator.attrgetter(*(f.name for f in fs))
    if len(fs) == 1:  # attrgetter of one name returns the value itself, not a tuple
        one = operator.attrgetter(fs[0].name)
        getter = lambda obj: (one(obj),)  # noqa: E731
    if cls.__name__ in _CHECKED:
        # The defaults as the constructor leaves them (e.g. `stop` None becomes []).
        defaults = getter(cls())
    else:
        defaults = tuple(
            f.default
            if f.default is not MISSING
            else f.default_factory()
            if f.default_factory is not MISSING
            else _NO_DEFAULT
            for f in fs
        )
    return getter, defaults, msgpack.ExtType(_EXT_MESSAGE, cls.__name__.encode())


class _CheckedBuilder:
    """Rebuilds a `checked_value` class from its sent field values, without ``__init__``."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.names = tuple(f.name for f in fields(cls))
        self._defaults: dict[str, object] | None = None  # by name, built on first use
        self._mutable: tuple[tuple[int, str], ...] = ()  # (index, name) of list/dict defaults

    def build(self, values: list[object]) -> object:
        if self._defaults is None:
            defaults = _layout(self.cls)[1]
            self._defaults = dict(zip(self.names, defaults))
            mutable = [i for i, d in enumerate(defaults) if isinstance(d, (list, dict))]
            self._mutable = tuple((i, self.names[i]) for i in mutable)
        obj: object = object.__new__(self.cls)
        # A frozen dataclass refuses setattr; its instance dict takes the fields as they are.
        state = obj.__dict__
        state.update(self._defaults)
        state.update(zip(self.names, values))
        for i, name in self._mutable:
            if i >= len(values):  # left out as a default: a list must not be shared
                state[name] = copy.copy(self._defaults[name])
        return obj


def _default(obj: object) -> list[object]:
    """A message as the array [tag, *values]: the tag (an extension value naming the class)
    lets the decoder rebuild it, and the values are packed inline by the same packer."""
    cls = type(obj)
    if _REGISTRY.get(cls.__name__) is not cls:
        if hasattr(cls, "__dataclass_fields__"):
            raise TypeError(f"{cls.__name__} is not a registered IPC message")
        raise TypeError(f"cannot send {cls.__name__} over IPC")
    getter, defaults, tag = _layout(cls)
    values = getter(obj)
    n = len(values)
    # Same type as well as equal: False must not be dropped for a default of 0.
    while n and type(values[n - 1]) is type(defaults[n - 1]) and values[n - 1] == defaults[n - 1]:
        n -= 1
    return [tag, *values[:n]]


def _ext_hook(code: int, data: bytes) -> object:
    if code != _EXT_MESSAGE:
        return msgpack.ExtType(code, data)
    name = data.decode()
    return _CHECKED.get(name) or _REGISTRY[name]


def _list_hook(items: list[object]) -> object:
    # Only a message's array starts with a class or a builder (what _ext_hook makes of a tag).
    if items:
        head = items[0]
        if type(head) is type:
            return head(*items[1:])
        if type(head) is _CheckedBuilder:
            return head.build(items[1:])
    return items


def encode(msg: object) -> bytes:
    return msgpack.packb(msg, default=_default, use_bin_type=True)  # type: ignore[no-any-return]


def decode(data: bytes) -> object:
    """The message (or plain value) ``data`` encodes; its type is the receiver's to check."""
    return msgpack.unpackb(  # type: ignore[no-any-return]
        data, ext_hook=_ext_hook, list_hook=_list_hook, raw=False, strict_map_key=False
    )
