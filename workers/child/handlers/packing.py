"""Sequence packing for encoder models: several short texts share one row of the batch, each
attending only to itself, so a batch costs its real tokens rather than rows × the longest text.

Padding is where batched CPU inference goes: with texts of 5 to 32 tokens, a padded batch of
16 is half padding. Rows are as wide as the longest text in the batch, so attention (quadratic
in the row width) never costs more than the padded batch would, and a batch of equal lengths
packs to exactly the padded batch.
"""
from __future__ import annotations

from typing import Sequence


def pack_rows(lengths: Sequence[int]) -> list[list[int]]:
    """First-fit decreasing: the indices of `lengths` placed in rows no wider than the longest
    one. Every index appears exactly once."""
    width = max(lengths, default=0)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows
