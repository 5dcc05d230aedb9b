"""bench.baseline starts an earlier commit's stack with that commit's own launcher."""
import sys
from pathlib import Path

import pytest

from bench import baseline


def _tree(tmp_path: Path, name: str, launchers: dict[str, str]) -> Path:
    tree = tmp_path / name
    for rel, marker in launchers.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(f"WHERE = {marker!r}\n")
    return tree


@pytest.mark.parametrize("launchers, expected", [
    # Since c2b6f63 the launcher is scripts/stack.py (the tests/support copy is gone).
    ({"scripts/stack.py": "scripts"}, "scripts"),
    # Before it, tests/support/services.py (9ccd8b9, the issue-14 baseline).
    ({"tests/support/services.py": "tests"}, "tests"),
])
def test_the_launcher_is_found_where_the_commit_kept_it(tmp_path, launchers, expected):
    tree = _tree(tmp_path, f"commit-{expected}", launchers)
    assert baseline.launcher(tree).WHERE == expected


def test_a_baseline_that_is_no_commit_is_named_in_the_error():
    with pytest.raises(SystemExit, match="--baseline no-such-rev: not a commit"):
        baseline.resolve("no-such-rev")


def test_a_launcher_split_in_modules_imports_its_own_tree(tmp_path):
    """main's scripts/stack.py imports scripts/processes.py (whose ROOT is where processes
    start): the tree's, not this checkout's, which stays as it was for everyone else."""
    import scripts.processes as ours

    tree = tmp_path / "commit-split"
    (tree / "scripts").mkdir(parents=True)
    (tree / "scripts" / "processes.py").write_text("ROOT = 'the tree'\n")
    (tree / "scripts" / "stack.py").write_text("from scripts.processes import ROOT\n")
    assert baseline.launcher(tree).ROOT == "the tree"
    import scripts.processes as again

    assert again is ours and str(tree) not in sys.path
