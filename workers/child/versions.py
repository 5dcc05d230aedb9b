"""A model's version, in the pool child that loads it: the `version:` its entry declares, or a
short hash of what defines it, its weights' contents and its settings (config.models
`settings_digest`). Every file of a model's folder (or its one file) is hashed whole; a file's
digest is kept on disk by its path, size, modification time and inode, so that the next child
that loads the same weights (a reload, another child on the host) reads a few bytes instead of
gigabytes."""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from config.models import ModelSpec, settings_digest

logger = logging.getLogger(__name__)

VERSION_CHARS = 12


def model_version(spec: ModelSpec) -> str:
    if spec.version:
        return spec.version
    digest = hashlib.sha256(settings_digest(spec).encode())
    for name, file_digest in weight_digests(spec):
        digest.update(f"\0{name}\0{file_digest}".encode())
    return digest.hexdigest()[:VERSION_CHARS]


def _weights_root(spec: ModelSpec) -> Path | None:
    if spec.package:
        from workers.child.handlers.folders import package_model_dir

        return package_model_dir(spec.package)
    return Path(spec.path) if spec.path else None


def weight_digests(spec: ModelSpec) -> list[tuple[str, str]]:
    """(name relative to the model's folder, sha256) for every file of the model, in name
    order; none for a model without files (synthetic)."""
    root = _weights_root(spec)
    if root is None:
        return []
    if root.is_file():
        return [(root.name, file_digest(root))]
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return [(p.relative_to(root).as_posix(), file_digest(p)) for p in files]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "inference-queue" / "digests"


def file_digest(path: Path) -> str:
    """The sha256 of a file's contents, from the cache when the file is unchanged since."""
    info = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{info.st_size}|{info.st_mtime_ns}|"
                         f"{info.st_ino}".encode()).hexdigest()
    cached = _cache_dir() / key
    try:
        return cached.read_text().strip()
    except OSError:
        pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        cached.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}")
        partial.write_text(digest)
        partial.replace(cached)
    except OSError as exc:  # a read-only home: hash again next time
        logger.debug("digest of %s not cached: %s", path, exc)
    return digest
