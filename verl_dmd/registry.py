"""Name -> implementation registries: a decorator for built-ins, an entry-point group for packages.

Every extension point of verl_dmd (model adapters, distillation methods, data
providers, validators) is a `Registry`: a class registers itself with
``@registry.register("name")``, and a separately installed package does the same in a
module named in the registry's entry-point group, which is imported on first use.
An unknown name is a one-line error naming the config key, listing what is
registered and the group to install from. A broken plugin is reported with a
warning and never hides the built-ins. `check_name(name)` answers what `get` would
without importing the built-in modules when their names (`builtin_names`) and
the absence of plugins settle it: the driver's pre-flight refuses a misspelt
name in a second, not after importing diffusers.

Layer 1: the standard library only.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)


class UnknownNameError(ValueError):
    """A config key names nothing registered; the message is one line."""


class Registry(Generic[T]):
    """One extension point: `kind` names it in errors, `key` is the config key that selects an entry."""

    def __init__(
        self,
        kind: str,
        *,
        key: str,
        entry_point_group: str,
        builtin_modules: tuple[str, ...] = (),
        builtin_names: tuple[str, ...] = (),
        check: Callable[[str, object], None] | None = None,
    ) -> None:
        self.kind = kind
        self.key = key
        self.entry_point_group = entry_point_group
        self.builtin_modules = builtin_modules
        self.builtin_names = builtin_names
        """What `builtin_modules` register (a test keeps them equal), known without importing them."""
        self._check = check
        self._entries: dict[str, T] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: make the decorated class (or function) available as ``<key>=<name>``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a non-empty name, got {name!r}")

        def decorate(entry: T) -> T:
            if self._check is not None:
                self._check(name, entry)
            existing = self._entries.get(name)
            if existing is not None and existing is not entry:
                raise ValueError(
                    f"{self.kind} {name!r} is registered twice ({_qualname(existing)} and {_qualname(entry)}); "
                    "pick another name"
                )
            self._entries[name] = entry
            return entry

        return decorate

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for module in self.builtin_modules:
            importlib.import_module(module)
        for entry in importlib.metadata.entry_points(group=self.entry_point_group):
            try:
                entry.load()  # importing the module runs its registrations
            except Exception as err:  # a broken plugin must not hide the built-ins
                logger.warning("verl_dmd: %s entry point %r failed to load: %s", self.kind, entry.name, err)

    def names(self) -> list[str]:
        """Every registered name, built-in and from entry points."""
        self._load()
        return sorted(self._entries)

    def get(self, name: str) -> T:
        """The entry registered as `name`; an unknown name is an `UnknownNameError` listing the known ones."""
        self._load()
        try:
            return self._entries[name]
        except KeyError:
            raise self._unknown(name, self._entries) from None

    def check_name(self, name: str) -> None:
        """Raise the `UnknownNameError` that `get(name)` would, importing nothing while the answer is known
        without: a built-in name exists; any other name is unknown when no package extends this registry
        (no entry point in its group). Otherwise `get` decides."""
        if name in self._entries or name in self.builtin_names:
            return
        if not self._loaded and not importlib.metadata.entry_points(group=self.entry_point_group):
            raise self._unknown(name, {*self._entries, *self.builtin_names})
        self.get(name)

    def _unknown(self, name: str, known) -> UnknownNameError:
        return UnknownNameError(
            f"config key '{self.key}' = {name!r}: no such {self.kind}; registered: "
            f"{', '.join(sorted(known)) or 'none'}; fix: pick one, or install the package that "
            f"registers it (entry-point group {self.entry_point_group!r})"
        )


def _qualname(entry: object) -> str:
    return f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', repr(entry))}"
