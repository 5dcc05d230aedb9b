"""config/job_ids.py's uuid4_text and uuid4_hex: uuid.uuid4()'s text, made without a UUID."""
import uuid

from config.job_ids import new_job_id, uuid4_hex, uuid4_text


def test_random_ids_are_version_4_uuids_as_uuid4_writes_them():
    seen = set()
    for _ in range(2000):
        text, hexed = uuid4_text(), uuid4_hex()
        parsed = uuid.UUID(text)
        assert str(parsed) == text and parsed.version == 4 and parsed.variant == uuid.RFC_4122
        assert uuid.UUID(hexed).hex == hexed and uuid.UUID(hexed).version == 4
        seen.update((text, hexed))
    assert len(seen) == 4000
    # every bit but the six uuid4 fixes is drawn: each shows both values across the draws
    ones = zeros = 0
    for _ in range(200):
        value = uuid.UUID(uuid4_text()).int
        ones |= value
        zeros |= ~value
    fixed = (0xC000 << 48) | (0xF000 << 64)
    assert (ones & zeros) & ((1 << 128) - 1) == ((1 << 128) - 1) & ~fixed


def test_a_default_groups_job_id_is_still_a_uuid4():
    job_id = new_job_id()
    assert str(uuid.UUID(job_id)) == job_id and uuid.UUID(job_id).version == 4
