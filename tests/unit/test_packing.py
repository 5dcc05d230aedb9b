"""Sequence packing on its own: which texts share a row."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from workers.child.handlers.packing import pack_rows


@given(st.lists(st.integers(min_value=1, max_value=256), max_size=64))
def test_every_text_is_placed_once_and_no_row_is_wider_than_the_longest(lengths):
    rows = pack_rows(lengths)
    placed = sorted(i for row in rows for i in row)
    assert placed == list(range(len(lengths)))
    for row in rows:
        assert sum(lengths[i] for i in row) <= max(lengths)
    # Never more rows than a padded batch would have.
    assert len(rows) <= len(lengths)


def test_short_texts_share_rows():
    # 32 + (20 + 12) + (19 + 7 + 5) : three rows instead of six.
    rows = pack_rows([5, 7, 12, 19, 20, 32])
    assert len(rows) == 3
    assert sorted(map(sorted, rows)) == [[0, 1, 3], [2, 4], [5]]


def test_equal_lengths_pack_to_the_padded_batch():
    assert sorted(pack_rows([10] * 4)) == [[0], [1], [2], [3]]
