"""The `unsayable` kind: a model whose load fails with an error that cannot be said (its
`__str__` raises), for the test that its pool child still stops its worker
(tests/faults/test_child_cannot_load.py). Registered when a models file lists this module
under `kinds:`; its handler is named, not imported."""
from __future__ import annotations

from config.kinds import Kind, register

UNSAYABLE = register(Kind("unsayable", "text",
                          "tests.support.kinds.unsayable_handler:UnsayableHandler",
                          description="a load that fails with an error that cannot be said"))
