"""A plug-in kind's one registry: the names a flag accepts, each registered by the class that implements it, so the
flag's choices, its check and what a name builds all come from that registration (adding one is one file: the
implementation, registering itself).

The implementing module registers at import; the registry imports it on first use, so a configuration is checked
against every name even before anything else imported that module (the configuration sits below it)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, flag: str, module: str):
        self.flag = flag  # the option it serves, for errors ("--scheduling-policy")
        self.module = module  # where the implementations register themselves
        self._entries: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        """Class decorator: `name` selects the class."""

        def add(cls: type[T]) -> type[T]:
            if name in self._entries:
                raise ValueError(
                    f"{self.flag}: {name!r} is registered twice ({self._entries[name].__name__}, {cls.__name__})"
                )
            self._entries[name] = cls
            return cls

        return add

    def _loaded(self) -> dict[str, type[T]]:
        importlib.import_module(self.module)  # registers at first import; a no-op after
        return self._entries

    def __contains__(self, name: object) -> bool:
        return name in self._loaded()

    def __iter__(self) -> Iterator[str]:  # argparse lists and checks a flag's choices through these
        return iter(sorted(self._loaded()))

    def __len__(self) -> int:
        return len(self._loaded())

    def __getitem__(self, name: str) -> type[T]:
        return self._loaded()[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self)
