"""The `echo` kind's handler, imported only in the pool child that loads an echo model. Each
output names the process that made it, so that a test sees that a pool child answered."""
from __future__ import annotations

import os
from typing import Any

from workers.child.handlers.base import Handler


class EchoHandler(Handler):
    def initialize(self) -> None:
        self.times = self.spec.kind_settings["times"]
        self.sep = self.spec.kind_settings["sep"]

    def sample_inputs(self, count: int) -> list:
        return ["x"] * count

    def inference(self, batch: Any) -> Any:
        return [{"echo": self.sep.join([text] * self.times), "pid": os.getpid()}
                for text in batch]
