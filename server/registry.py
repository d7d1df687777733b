"""A registry of named extensions: KV codecs, placement policies, decode-module kinds.

Each extension point holds one :class:`Registry`; adding an extension is one file with the class
or function and one ``register`` line where its registry lives.

>>> colours = Registry[int]("colour", hint="pass it to register()")
>>> colours.register("red", 1)
1
>>> colours.names(), colours.get("red"), "red" in colours
(('red',), 1, True)
>>> colours.get("blue")
Traceback (most recent call last):
...
server.registry.UnknownName: unknown colour 'blue'; registered colours: red (pass it to register())
>>> colours.register("red", 2)
Traceback (most recent call last):
...
ValueError: colour 'red' is already registered; pass replace=True to replace it
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


class UnknownName(ValueError):
    """A name nothing is registered under; the message lists the registered ones."""


class Registry(Generic[T]):
    """Extensions of one kind by name, in registration order.

    ``what`` names the kind in messages (``plural``: its plural, default ``what + "s"``); ``error`` is raised for an unknown name (a subclass
    of :class:`UnknownName`, so callers can catch their own); ``hint`` says how to add one.
    """

    def __init__(
        self, what: str, *, plural: str = "", error: type[UnknownName] = UnknownName, hint: str = ""
    ) -> None:
        self.what, self.plural, self.error, self.hint = what, plural or what + "s", error, hint
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T, *, replace: bool = False) -> T:
        """Make ``item`` usable as ``name``; returns it. A taken name needs ``replace``."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"a {self.what}'s name is lowercase letters, digits, '.', '_' or '-', got {name!r}")
        if name in self._items and not replace:
            raise ValueError(f"{self.what} {name!r} is already registered; pass replace=True to replace it")
        self._items[name] = item
        return item

    def unregister(self, name: str) -> None:
        """Forget ``name`` (tests' toy extensions); unknown names raise as :meth:`get` does."""
        self.get(name)
        del self._items[name]

    def get(self, name: Any) -> T:
        """The extension registered as ``name``."""
        item = self._items.get(name) if isinstance(name, str) else None
        if item is None:
            hint = f" ({self.hint})" if self.hint else ""
            raise self.error(f"unknown {self.what} {name!r}; registered {self.plural}: {', '.join(self._items)}{hint}")
        return item

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)
