"""One replaced method of a kombu or Celery class, and how it is put back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Patch:
    """`owner.name` replaced by `build(original)`. The method must be defined on `owner`
    itself, not inherited: an upgrade that moves or renames it fails here, at install, rather
    than leave the replacement unused."""

    owner: type
    name: str
    build: Callable[[Any], Any]
    original: Any = field(default=None, init=False)

    def apply(self) -> None:
        if self.name not in vars(self.owner):
            raise RuntimeError(f"{self.owner.__module__}.{self.owner.__qualname__} no longer "
                               f"defines {self.name}: the installed kombu or Celery is not "
                               "the one workers/broker/ was written for")
        self.original = vars(self.owner)[self.name]
        setattr(self.owner, self.name, self.build(self.original))

    def revert(self) -> None:
        setattr(self.owner, self.name, self.original)
