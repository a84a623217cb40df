"""Name → frozen-dataclass registries (architectures, schemes, targets)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

from qwen2om.errors import Qwen2omError


class _Named(Protocol):
    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=_Named)


class UnknownNameError(Qwen2omError):
    """A registry lookup missed; the message lists what exists."""


class Registry(Generic[T]):
    """An ordered name → entry map whose misses say what is known."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def add(self, item: T) -> T:
        if item.name in self._items:
            raise ValueError(f"{self.kind} {item.name!r} registered twice")
        self._items[item.name] = item
        return item

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} {name!r} (known: {', '.join(self._items)})"
            ) from None

    def names(self) -> list[str]:
        return list(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items.values())

    def __contains__(self, name: object) -> bool:
        return name in self._items
