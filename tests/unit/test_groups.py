"""Redis groups (config/groups.py, app/group_stores.py's merge of pages): the setting, a model's
`redis`, the job ids that name their group, and how the groups' pages of a listing merge."""
from __future__ import annotations

import uuid

import pytest
import yaml

from app.group_stores import merge_pages
from config import ConfigError, load_models, load_settings
from config.job_ids import group_of, group_tag, new_job_id
from config.models import settings_digest
from tasks.celery_app import make_celery
from tasks.jobstate import Page, new_job

A, B = "redis://:pw@a:6379/0", "redis://b:6380/0"


def test_groups_come_from_the_yaml_mapping_and_the_environment(tmp_path):
    config_file = tmp_path / "service.yaml"
    config_file.write_text(yaml.safe_dump({"redis_groups": {"gpu": A, "cpu_2": B}}))
    config_file.chmod(0o600)  # A's password: the operator's alone
    assert load_settings(environ={"IQ_CONFIG": str(config_file)}).redis_group_urls == {
        "gpu": A, "cpu_2": B}
    assert load_settings(environ={"IQ_REDIS_GROUPS": f"gpu={A}, cpu_2={B}"}) \
        .redis_group_urls == {"gpu": A, "cpu_2": B}
    assert load_settings(environ={}).redis_group_urls == {}
    shown = repr(load_settings({"redis_groups": f"gpu={A}"}, environ={}))
    assert "pw" not in shown and "redis_groups='gpu=redis://:**@a:6379/0'" in shown


@pytest.mark.parametrize("raw, message", [
    ("gpu", "redis_groups must list name=url entries, comma-separated, got 'gpu'"),
    (f"GPU={B}", "a group name is a lower-case letter.*got 'GPU'"),
    ("gpu=http://h:1", r"redis_groups.gpu must be a redis://, rediss:// or unix:// URL, got "
                       r"'http://h:1'"),
    (f"gpu={B},gpu=redis://c:1/0", "group 'gpu' is named twice"),
    (f"gpu={B},cpu={B}", r"redis_groups.cpu: 'redis://b:6380/0' is already the Redis of "
                         r"another group"),
])
def test_group_mistakes_name_the_setting_and_the_value(raw, message):
    with pytest.raises(ConfigError, match=message):
        load_settings({"redis_groups": raw}, environ={})


def test_a_mapping_of_the_wrong_kind_is_named(tmp_path):
    config_file = tmp_path / "service.yaml"
    config_file.write_text(yaml.safe_dump({"redis_groups": [A]}))
    with pytest.raises(ConfigError, match=r"redis_groups must be a mapping of name to Redis "
                                          r"URL.*got \['redis://:pw@a:6379/0'\]"):
        load_settings(environ={"IQ_CONFIG": str(config_file)})


def models_file(tmp_path, **redis):
    models = {name: {"kind": "synthetic", **({"redis": group} if group else {})}
              for name, group in redis.items()}
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump({"models": models}))
    return path


def test_a_model_names_its_group_and_an_unknown_one_is_refused_at_load(tmp_path):
    models = load_models(models_file(tmp_path, one="", two="gpu"))
    assert (models["one"].redis, models["two"].redis) == ("", "gpu")
    # Where its queue is does not make another version of the model.
    assert settings_digest(models["one"]) == settings_digest(
        load_models(models_file(tmp_path, one="gpu"))["one"])
    make_celery(load_settings({"redis_groups": f"gpu={B}"}, environ={}), models)
    with pytest.raises(ConfigError, match=r"models.two: redis must name a group of "
                                          r"redis_groups \(cpu\), got 'gpu'"):
        make_celery(load_settings({"redis_groups": f"cpu={B}"}, environ={}), models)
    with pytest.raises(ConfigError, match=r"models.two: redis must name a group of "
                                          r"redis_groups \(none is configured\), got 'gpu'"):
        make_celery(load_settings(environ={}), models)
    with pytest.raises(ConfigError, match="models.bad: redis must name a group.*got 'No'"):
        load_models(models_file(tmp_path, bad="No"))


def test_a_job_id_names_its_group_and_the_default_ones_are_as_before():
    tags = {group_tag("gpu"): "gpu", group_tag("cpu"): "cpu"}
    default = uuid.UUID(new_job_id())
    assert default.version == 4 and group_of(str(default), tags) == ""
    for group in ("gpu", "cpu"):
        job_id = new_job_id(group)
        parsed = uuid.UUID(job_id)
        assert str(parsed) == job_id and parsed.version == 8
        assert parsed.variant == uuid.RFC_4122
        assert job_id.startswith(group_tag(group)) and group_of(job_id, tags) == group
    assert new_job_id("gpu") != new_job_id("gpu")
    # A tag of no configured group: no store holds it (404), none is asked.
    assert group_of(new_job_id("gone"), tags) is None
    # Without groups every id is the default Redis's, as it always was.
    assert group_of(new_job_id("gpu"), {}) == ""


def page(entries: list[tuple[int, str]], cursor: tuple[int, str] | None):
    jobs = [new_job(job_id, model="m", trace_id="t", inputs=1, priority="normal") for _, job_id in entries]
    return Page(jobs, (str(cursor[0]), cursor[1]) if cursor else None,
                [us for us, _ in entries])


def ids(merged: Page) -> list[str]:
    return [job.id for job in merged.jobs]


def test_pages_merge_newest_first_down_to_where_every_group_was_read():
    # Group one read to (5, "e") and has more; group two holds (6, "f"), (3, "c"): all.
    one = page([(9, "i"), (7, "g"), (5, "e")], (5, "e"))
    two = page([(6, "f"), (3, "c")], None)
    merged = merge_pages([one, two], limit=3)
    assert ids(merged) == ["i", "g", "f"] and merged.cursor == ("6", "f")
    merged = merge_pages([one, two], limit=10)
    # (3, "c") is older than where group one stopped: it comes with the next page.
    assert ids(merged) == ["i", "g", "f", "e"] and merged.cursor == ("5", "e")
    # Both done: every job, no cursor; the merged page carries each job's time.
    merged = merge_pages([page([(9, "i")], None), two], limit=10)
    assert ids(merged) == ["i", "f", "c"] and merged.cursor is None
    assert merged.times == [9, 6, 3]
    # Equal scores order by id, newest (largest) first, as each index orders them.
    merged = merge_pages([page([(4, "b")], None), page([(4, "d"), (4, "a")], None)], limit=2)
    assert ids(merged) == ["d", "b"] and merged.cursor == ("4", "b")
