"""Job ids, minted by the API: an id says which Redis group holds the job (config/groups.py),
with no lookup. A job of the default group has a random UUID (version 4), as always; a job of a
named group a UUID of version 8 (RFC 9562) whose first eight hex digits are its group's tag
(`group_tag`), the rest random. Nothing here imports Flask or torch."""
from __future__ import annotations

import hashlib
import secrets
import uuid
from binascii import b2a_base64
from typing import Mapping

from config.process import random_bytes

# uuid.UUID(version=4)'s bits: the version field 4, RFC 4122's variant.
_V4_CLEAR = ~((0xC000 << 48) | (0xF000 << 64))
_V4_SET = (0x8000 << 48) | (4 << 76)


def uuid4_hex() -> str:
    """`uuid.uuid4().hex`: 16 random bytes of the kernel's source (as os.urandom; config/
    process.py) with the same version and variant bits, without building a `uuid.UUID`, whose
    checks cost ~2 µs each time; a submit makes three (its job id, its trace id, its message's
    delivery tag)."""
    return "%032x" % ((int.from_bytes(random_bytes(16), "big") & _V4_CLEAR) | _V4_SET)


def uuid4_text() -> str:
    """`str(uuid.uuid4())`, as `uuid4_hex`."""
    h = uuid4_hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def group_tag(name: str) -> str:
    """The eight hex digits that open the id of every job of group `name`."""
    return hashlib.sha256(f"iq-redis-group:{name}".encode()).hexdigest()[:8]


# base64's alphabet made URL-safe, as base64.urlsafe_b64encode makes it.
_URL_SAFE = bytes.maketrans(b"+/", b"-_")


def token_text(size: int) -> str:
    """`secrets.token_urlsafe(size)`, of config/process.py's random bytes (binascii's base64
    made URL-safe, as base64.urlsafe_b64encode does in three Python calls)."""
    return b2a_base64(random_bytes(size), newline=False).translate(_URL_SAFE).rstrip(
        b"=").decode("ascii")


def new_job_id(group: str = "") -> str:
    """A new job id of `group` ("" : the default group's, a random UUID as always)."""
    if not group:
        return uuid4_text()
    value = (int(group_tag(group), 16) << 96) | secrets.randbits(96)
    value = (value & ~(0xF << 76)) | (0x8 << 76)  # version 8
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # RFC 9562's variant
    return str(uuid.UUID(int=value))


def group_of(job_id: str, tags: Mapping[str, str]) -> str | None:
    """The group of a canonical job id: "" for the default group's, the name for a version-8
    id carrying the tag of a group in `tags` (tag → name), None for one carrying no known
    tag (a group since removed, or an id never issued)."""
    if not tags or job_id[14] != "8":
        return ""
    return tags.get(job_id[:8])
