"""mkdocs hooks (mkdocs.yml `hooks:`): the pages that are generated when the site is built, so
that they cannot drift from what they describe.

* docs/configuration.md: its `<!-- settings -->` marker becomes the table of every setting,
  the names and defaults read from config/settings.py's `Settings`, the meanings from
  docs/settings.yml. A setting without a meaning, or a meaning for no setting, fails the build.
* a `<!-- README.md: <section> -->` marker in any page becomes that section of README.md (its
  curl session, which the tests run: one copy), its links made the site's.
* docs/performance.md: its `<!-- bench/README.md -->` marker becomes bench/README.md (the
  benchmark report), its headings one level down, and the images it shows are published
  beside it.
"""
from __future__ import annotations

import re
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # mkdocs loads a hook by its path, not as a package module
    sys.path.insert(0, str(ROOT))

from config.settings import ENV_NAMES, PROJECT_DIR, Settings  # noqa: E402

MEANINGS = ROOT / "docs" / "settings.yml"
BENCH = ROOT / "bench" / "README.md"
SETTINGS_MARK = "<!-- settings -->"
BENCH_MARK = "<!-- bench/README.md -->"
README = ROOT / "README.md"
README_MARK = re.compile(r"<!-- README\.md: (?P<section>[^>]+?) -->")
LOCAL_LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)\s]+)\)")


class DocsError(Exception):
    """The docs and the code they describe disagree; the message says where."""


def shown(value) -> str:
    """A setting's default as a reader writes it in the environment."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return "none"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, str) and value.startswith(f"{PROJECT_DIR}/"):
        return value[len(str(PROJECT_DIR)) + 1:]
    return str(value)


def settings_table(rows: list | None = None) -> str:
    """The Markdown table of every setting: name and default from `Settings`, meaning from
    docs/settings.yml (or `rows`, in its shape)."""
    rows = yaml.safe_load(MEANINGS.read_text()) if rows is None else rows
    defaults = {f.name: f.default for f in fields(Settings) if f.default is not MISSING}
    listed = [name for row in rows for name in row["settings"]]
    unknown = [name for name in listed if name not in ENV_NAMES]
    missing = [name for name in ENV_NAMES if name not in listed]
    twice = sorted({name for name in listed if listed.count(name) > 1})
    if unknown or missing or twice:
        raise DocsError("docs/settings.yml disagrees with config/settings.py: "
                        f"no such setting {unknown}, not described {missing}, twice {twice}")
    lines = ["| Setting (env) | Default | Meaning |", "|---|---|---|"]
    for row in rows:
        names = ", ".join(f"`{name}`" for name in row["settings"])
        default = ", ".join(f"`{shown(defaults[ENV_NAMES[name]])}`" for name in row["settings"])
        if row.get("default"):
            default += f" ({row['default']})"
        lines.append(f"| {names} | {default} | {row['meaning']} |")
    return "\n".join(lines)


def bench_report() -> tuple[str, list[str]]:
    """bench/README.md with its headings one level down and its local links made relative to
    the site's root, and the files (under bench/) those links name."""
    text, cited, fence = [], [], False
    for line in BENCH.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        if not fence and line.startswith("#"):
            line = "#" + line
        text.append(line)

    def local(match: re.Match) -> str:
        target = f"bench/{match.group(1)}"
        if not (ROOT / target.split("#")[0]).is_file():
            raise DocsError(f"bench/README.md links to {match.group(1)}, which is not there")
        cited.append(target.split("#")[0])
        return f"]({target})"

    return LOCAL_LINK.sub(local, "\n".join(text)), cited


def readme_section(title: str) -> str:
    """The body of README.md's `## <title>` section, its links to docs/ pages made relative
    to the site's pages and its link to the benchmark report the Performance page's."""
    parts = README.read_text().split(f"\n## {title}\n", 1)
    if len(parts) != 2:
        raise DocsError(f"README.md has no section {title!r}")
    body = parts[1].split("\n## ", 1)[0]
    return body.replace("](docs/", "](").replace("](bench/README.md", "](performance.md")


def on_files(files, config):
    from mkdocs.structure.files import File
    for path in bench_report()[1]:
        files.append(File.generated(config, path, abs_src_path=str(ROOT / path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    from mkdocs.exceptions import PluginError
    try:
        markdown = README_MARK.sub(lambda m: readme_section(m["section"]), markdown)
        if page.file.src_uri == "configuration.md":
            return _replace(markdown, SETTINGS_MARK, settings_table())
        if page.file.src_uri == "performance.md":
            return _replace(markdown, BENCH_MARK, bench_report()[0])
    except DocsError as exc:
        raise PluginError(str(exc)) from exc
    return markdown


def _replace(markdown: str, mark: str, text: str) -> str:
    if mark not in markdown:
        raise DocsError(f"the page lost its {mark} marker")
    return markdown.replace(mark, text)
