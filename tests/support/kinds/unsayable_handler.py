"""The `unsayable` kind's handler: its load raises an error whose message cannot be made."""
from __future__ import annotations

from workers.child.handlers.base import Handler


class Unsayable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this error cannot be said")


class UnsayableHandler(Handler):
    def initialize(self) -> None:
        raise Unsayable()

    def sample_inputs(self, count: int) -> list:
        return ["x"] * count

    def inference(self, batch: list) -> list:
        return batch
