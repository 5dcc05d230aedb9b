"""Redis key names (tasks/keys.py)."""
from __future__ import annotations

from tasks.keys import idempotency_key


def test_an_idempotency_key_is_scoped_to_its_api_key_without_ambiguity():
    # Key "ops" sending "batch:k1" must not reach the claim of key "ops:batch" sending "k1".
    assert idempotency_key("ops", "batch:k1") != idempotency_key("ops:batch", "k1")
    assert idempotency_key("", "k") != idempotency_key("k", "")
    assert idempotency_key("ops", "k1") == idempotency_key("ops", "k1")
