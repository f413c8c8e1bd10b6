"""One registry class for every extension point: a name -> component table.

Dataset parsers, client objectives, server hooks, classifier architectures,
evaluation protocols and gallery index kinds are each a :class:`Registry`::

    OBJECTIVES = Registry("client objective", locations=("fedreid.fl.local.objectives",))

    @OBJECTIVES.register            # under the class's ``name`` attribute
    class FedProx(LocalObjective): name = "fedprox"

    @CLASSIFIERS.register("cnn")    # or under an explicit name
    def cnn(**kw): ...

    OBJECTIVES.get("fedprx", where="train.objective")
    # UnknownNameError: train.objective: unknown 'fedprx' (did you mean fedprox?); known: fedavg, ...

``locations`` are the modules whose import registers the built-in entries;
they are imported on the first lookup (as mmengine's ``Registry(locations=)``
does), so a registry can be consulted without its caller importing every
implementation. A registry reads like a read-only mapping (``name in reg``,
``reg[name]``, iteration in registration order) so code that only looks up
names needs nothing else.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Generic, Iterator, Optional, Sequence, TypeVar, overload

from fedreid.options import ConfigError, did_you_mean

T = TypeVar("T")


class UnknownNameError(ConfigError, KeyError):
    """A name that no entry of a registry has; the message lists close and known names.

    Also a :class:`KeyError` (a failed lookup in a table), printed without
    KeyError's quotes.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _default_name(obj: Any) -> str:
    name = getattr(obj, "name", None)
    return name if isinstance(name, str) else getattr(obj, "__name__", "")


class Registry(Generic[T]):
    """Components of one kind by name.

    ``kind`` names the extension point in messages ("client objective").
    ``locations``: modules imported on the first lookup, which register the
    built-ins. ``unknown``: the :class:`UnknownNameError` subclass that
    :meth:`get` raises. ``name_of(obj)`` gives the name of a component
    registered without one: its ``name`` attribute if it is a string, else its
    ``__name__``.
    """

    def __init__(
        self,
        kind: str,
        *,
        locations: Sequence[str] = (),
        unknown: type[UnknownNameError] = UnknownNameError,
        name_of: Callable[[Any], str] = _default_name,
    ) -> None:
        self.kind = kind
        self.locations = tuple(locations)
        self.unknown = unknown
        self._name_of = name_of
        self._entries: dict[str, T] = {}
        self._loaded = not self.locations

    # ------------------------------------------------------------ registering

    @overload
    def register(self, obj: T, *, name: Optional[str] = None) -> T: ...

    @overload
    def register(self, obj: Optional[str] = None, *, name: Optional[str] = None) -> Callable[[T], T]: ...

    def register(self, obj=None, *, name=None):  # type: ignore[no-untyped-def]
        """Add a component; usable as ``@reg.register``, ``@reg.register("name")`` or ``reg.register(obj)``.

        Registering the same object under its name again is a no-op; a name
        taken by another object, or an empty name, raises :class:`ValueError`
        (a programming error, not bad input).
        """
        if obj is None or isinstance(obj, str):
            explicit = obj if isinstance(obj, str) else name
            return lambda component: self._add(component, explicit)
        return self._add(obj, name)

    def _add(self, obj: T, name: Optional[str]) -> T:
        key = name if name is not None else self._name_of(obj)
        if not isinstance(key, str) or not key:
            raise ValueError(f"{obj!r} has no {self.kind} name to register under")
        taken = self._entries.get(key)
        if taken is not None and taken is not obj:
            raise ValueError(f"{self.kind} name {key!r} is taken by {getattr(taken, '__name__', taken)!r}")
        self._entries[key] = obj
        return obj

    def copy(self) -> "Registry[T]":
        """An independent registry with the same entries (a test registers into a copy)."""
        self._load()
        other: Registry[T] = Registry(self.kind, unknown=self.unknown, name_of=self._name_of)
        other._entries = dict(self._entries)
        return other

    # ------------------------------------------------------------ looking up

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True  # before importing: a location may consult the registry while it loads
            for module in self.locations:
                importlib.import_module(module)

    def get(self, name: str, *, where: Optional[str] = None) -> T:
        """The component registered as ``name``; :attr:`unknown` (a ConfigError) with close names otherwise.

        ``where`` is the config key or option that gave the name; the message
        then starts with it instead of the registry's kind.
        """
        self._load()
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            pass
        known = self.names()
        lead = f"{where}: unknown {name!r}" if where else f"unknown {self.kind} {name!r}"
        raise self.unknown(f"{lead}{did_you_mean(str(name), known)}; known: {', '.join(known) or 'none'}")

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        self._load()
        return sorted(self._entries)

    def keys(self) -> list[str]:
        """The names in registration order."""
        self._load()
        return list(self._entries)

    def values(self) -> list[T]:
        self._load()
        return list(self._entries.values())

    def items(self) -> list[tuple[str, T]]:
        self._load()
        return list(self._entries.items())

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        self._load()
        return iter(list(self._entries))

    def __len__(self) -> int:
        self._load()
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {len(self._entries)} entries)"


__all__ = ["Registry", "UnknownNameError"]
