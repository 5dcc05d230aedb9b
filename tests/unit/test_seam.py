"""The private names the service relies on (workers/broker/seam.py) are still where the
installed kombu, Celery, billiard and redis-py keep them, taking what they took; and
docs/upgrading.md's table lists exactly them. A version that moves, renames or changes one
fails here, naming it, at test time."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from workers.broker import seam

DOC = Path(__file__).resolve().parents[2] / "docs" / "upgrading.md"


def owner_of(name: seam.Name) -> str:
    return str(name).rpartition(".")[0]


@pytest.mark.parametrize("name", seam.every(), ids=str)
def test_each_private_name_is_where_the_service_expects_it(name):
    assert name.problem() is None


def documented() -> set[tuple[str, str]]:
    """(owner, name) for each name of docs/upgrading.md's table of private names."""
    text = DOC.read_text()
    table = text[text.index("## The private names"):]
    found: set[tuple[str, str]] = set()
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[1].startswith("`"):
            continue
        owner = cells[1].strip("`")
        found |= {(owner, n) for n in re.findall(r"`([A-Za-z_][\w]*)`", cells[2])}
    return found


def test_the_upgrading_guide_lists_exactly_these_names():
    listed = {(owner_of(n), n.name) for n in seam.every()}
    in_doc = documented()
    assert sorted(listed - in_doc) == [], "in workers/broker/seam.py, not in docs/upgrading.md"
    assert sorted(in_doc - listed) == [], "in docs/upgrading.md, not in workers/broker/seam.py"


def test_a_moved_or_changed_name_is_named():
    class Old:
        def kept(self, a, b=1):
            pass

        def changed(self, a):
            self.attribute = a

    class New(Old):  # `kept` inherited, no longer defined here
        def changed(self, a, extra):
            pass

    assert seam.Name(Old, "kept", ("self", "a", "b")).problem() is None
    assert seam.Name(Old, "attribute").problem() is None
    assert "no longer defines kept" in seam.Name(New, "kept", ("self", "a", "b")).problem()
    assert "New.changed now takes ('self', 'a', 'extra')" in \
        seam.Name(New, "changed", ("self", "a")).problem()
    assert "New.attribute is no longer set" in seam.Name(New, "attribute").problem()
