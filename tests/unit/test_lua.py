"""tasks/lua.py, the loader of the Lua scripts in tasks/lua/: includes expanded where they are
named, comment lines left in the file, a loop or a missing file refused by name, constants
given as Lua locals (only those the text uses), each value as the Lua literal of the same
bytes."""
from __future__ import annotations

import pytest

from tasks import lua


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setattr(lua, "FOLDER", tmp_path)
    lua.source.cache_clear()
    yield tmp_path
    lua.source.cache_clear()


def test_an_include_is_replaced_by_its_fragment_where_it_is_named(folder):
    (folder / "_inner.lua").write_text("local x = 1\n")
    (folder / "_outer.lua").write_text("local w = 0\n-- #include _inner\nlocal y = x\n")
    (folder / "main.lua").write_text("-- #include _outer\nreturn y\n")
    assert lua.script("main") == "local w = 0\nlocal x = 1\nlocal y = x\nreturn y\n"
    assert lua.includes("main") == ["_outer"]


def test_comment_and_blank_lines_stay_in_the_file(folder):
    (folder / "main.lua").write_text("-- What it does.\n\n  -- why\nlocal s = '--' -- kept\n"
                                     "return s\n")
    assert lua.script("main") == "local s = '--' -- kept\nreturn s\n"


def test_a_file_is_read_once(folder):
    (folder / "main.lua").write_text("return 1\n")
    assert lua.script("main") == "return 1\n"
    (folder / "main.lua").write_text("return 2\n")
    assert lua.script("main") == "return 1\n"


def test_an_include_loop_is_refused_naming_it(folder):
    (folder / "_a.lua").write_text("-- #include _b\n")
    (folder / "_b.lua").write_text("-- #include _a\n")
    (folder / "main.lua").write_text("-- #include _a\n")
    with pytest.raises(ValueError, match=r"main -> _a -> _b -> _a"):
        lua.script("main")


def test_a_missing_script_is_refused_naming_its_path(folder):
    (folder / "main.lua").write_text("-- #include _gone\n")
    with pytest.raises(FileNotFoundError, match=r"_gone.*_gone\.lua is missing"):
        lua.script("main")


def test_only_the_constants_the_text_uses_are_declared_before_it(folder):
    (folder / "main.lua").write_text("return PREFIX .. KEEP_S\n")
    text = lua.script("main", {"PREFIX": "iq:", "KEEP": ("a", "b"), "LIMIT": 8})
    assert text == "local PREFIX = 'iq:'\nreturn PREFIX .. KEEP_S\n"


@pytest.mark.parametrize("value, literal", [
    ("iq:job:", "'iq:job:'"),
    ("\x06\x16", "'\\6\\22'"),  # the priority separator: control characters
    ("it's a\\b", "'it\\39s a\\92b'"),
    ("é", "'\\195\\169'"),  # UTF-8, byte by byte
    (8, "8"),
    (0.5, "0.5"),
    (("status", "token"), "{'status', 'token'}"),
])
def test_values_become_lua_literals(value, literal):
    assert lua.literal(value) == literal


def test_a_value_with_no_lua_literal_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"dict \{'a': 1\}"):
        lua.literal({"a": 1})


def test_another_folder_is_read_the_same_way_and_includes_the_shared_fragments(folder,
                                                                               tmp_path_factory):
    own = tmp_path_factory.mktemp("own")
    (folder / "_shared.lua").write_text("local shared = SEP\n")
    (own / "_mine.lua").write_text("-- #include _shared\nlocal mine = shared\n")
    (own / "main.lua").write_text("-- A script of another folder.\n-- #include _mine\n"
                                  "return mine\n")
    assert lua.script("main", {"SEP": "\x06"}, folder=own) == \
        "local SEP = '\\6'\nlocal shared = SEP\nlocal mine = shared\nreturn mine\n"
    assert lua.includes("main", own) == ["_mine"]
    with pytest.raises(FileNotFoundError, match=r"main\.lua is missing"):
        lua.script("main")  # tasks/lua/ has no such script
