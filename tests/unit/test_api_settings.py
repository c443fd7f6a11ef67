"""The API's settings: their defaults and variables as they were before pydantic-settings (the literals below are
what api/settings.py gave at 810280c), the refusal of a bad value of each kind naming its variable, and the
README's table against the one the fields render."""

import os
from pathlib import Path

import pytest

from api.settings import (
    README,
    SETTINGS,
    TABLE_BEGIN,
    TABLE_END,
    ApiSettings,
    readme_with_table,
    settings_markdown,
    settings_text,
    variable,
)
from horizon_ray.errors import BadInput

# ApiSettings.from_env with nothing but HORIZON_RAY_HOME set, at 810280c (the dataclass of hand-parsed variables)
DEFAULTS_BEFORE = {
    "api_keys": {},
    "uploads_dir": Path("/h/service/uploads"),
    "jobs_root": Path("/h/service/jobs"),
    "data_roots": [],
    "model_roots": [],
    "model_catalogue": {},
    "max_body_bytes": 1048576,
    "max_upload_bytes": 1073741824,
    "sse_poll_s": 0.25,
    "sse_heartbeat_s": 15.0,
    "openai_api": True,
    "insecure_no_auth": False,
    "rate_limit_per_s": 20.0,
    "rate_limit_burst": 100,
    "max_streams_per_tenant": 100,
    "stream_poll_threads": 4,
    "max_uploads_in_flight": 2,
    "max_files_per_tenant": 1000,
    "max_file_bytes_per_tenant": 107374182400,
    "max_upload_line_bytes": 8388608,
    "tracker_hosts": [],
    "metrics_open": False,
    "docs": False,
}
# The table serve --help and the README printed at 810280c: (variable, default as shown)
TABLE_BEFORE = [
    ("HORIZON_API_KEYS", "none"),
    ("HORIZON_API_KEYS_FILE", "none"),
    ("HORIZON_RAY_HOME", "~/.cache/horizon-ray"),
    ("HORIZON_JOBS_ROOT", "<service root>/jobs"),
    ("HORIZON_UPLOADS_DIR", "<service root>/uploads"),
    ("HORIZON_MODEL_ROOTS", "none"),
    ("HORIZON_MODEL_CATALOGUE", "none"),
    ("HORIZON_DATA_ROOTS", "none"),
    ("HORIZON_TRACKER_HOSTS", "none"),
    ("HORIZON_ENGINE_ENV", "none"),
    ("HORIZON_API_MAX_BODY_BYTES", "1048576 (1 MiB)"),
    ("HORIZON_API_MAX_UPLOAD_BYTES", "1073741824 (1 GiB)"),
    ("HORIZON_API_MAX_UPLOAD_LINE_BYTES", "8388608 (8 MiB)"),
    ("HORIZON_API_RATE_LIMIT_PER_S", "20"),
    ("HORIZON_API_RATE_LIMIT_BURST", "100"),
    ("HORIZON_API_MAX_STREAMS_PER_TENANT", "100"),
    ("HORIZON_API_STREAM_POLL_THREADS", "4"),
    ("HORIZON_API_MAX_UPLOADS_IN_FLIGHT", "2"),
    ("HORIZON_API_MAX_FILES_PER_TENANT", "1000"),
    ("HORIZON_API_MAX_FILE_BYTES_PER_TENANT", "107374182400 (100 GiB)"),
    ("HORIZON_API_METRICS_OPEN", "0"),
    ("HORIZON_API_DOCS", "0"),
]


def fields_of(s: ApiSettings) -> dict:
    return {name: getattr(s, name) for name in DEFAULTS_BEFORE}


def test_the_defaults_are_those_of_before():
    assert fields_of(ApiSettings.from_env({"HORIZON_RAY_HOME": "/h"})) == DEFAULTS_BEFORE
    assert fields_of(ApiSettings.from_env({}, root="/h/service")) == DEFAULTS_BEFORE
    # by hand (tests, the demo): the same, the directories under the service root of this process's environment
    by_hand = fields_of(ApiSettings(uploads_dir="/h/service/uploads", jobs_root="/h/service/jobs"))
    assert by_hand == DEFAULTS_BEFORE
    # the same rows; the two variables other modules read (the home, the engines' extra names) now come last
    assert dict((s.env, s.default) for s in SETTINGS) == dict(TABLE_BEFORE)
    assert [s.env for s in SETTINGS][-2:] == ["HORIZON_RAY_HOME", "HORIZON_ENGINE_ENV"]


def test_every_variable_keeps_its_name_and_meaning(tmp_path):
    keys_file = tmp_path / "keys.json"
    keys_file.write_text('{"keys": {"file-key-0123456789": "team-f", "both-key-0123456789": "from-file"}}')
    env = {
        "HORIZON_API_KEYS": "env-key-0123456789=team-e, both-key-0123456789=from-env,",
        "HORIZON_API_KEYS_FILE": str(keys_file),
        "HORIZON_RAY_HOME": str(tmp_path / "home"),
        "HORIZON_JOBS_ROOT": str(tmp_path / "jobs"),
        "HORIZON_UPLOADS_DIR": str(tmp_path / "up"),
        "HORIZON_MODEL_ROOTS": f"{tmp_path}/m1{os.pathsep}{os.pathsep}{tmp_path}/m2",
        "HORIZON_MODEL_CATALOGUE": f"tiny={tmp_path}/m1/tiny, big = {tmp_path}/m2/big",
        "HORIZON_DATA_ROOTS": f"{tmp_path}/d",
        "HORIZON_TRACKER_HOSTS": " MLflow.Internal, ,b.example ",
        "HORIZON_API_MAX_BODY_BYTES": "2048",
        "HORIZON_API_MAX_UPLOAD_BYTES": "4096",
        "HORIZON_API_MAX_UPLOAD_LINE_BYTES": "512",
        "HORIZON_API_RATE_LIMIT_PER_S": "2.5",
        "HORIZON_API_RATE_LIMIT_BURST": "7",
        "HORIZON_API_MAX_STREAMS_PER_TENANT": "3",
        "HORIZON_API_STREAM_POLL_THREADS": "9",
        "HORIZON_API_MAX_UPLOADS_IN_FLIGHT": "5",
        "HORIZON_API_MAX_FILES_PER_TENANT": "11",
        "HORIZON_API_MAX_FILE_BYTES_PER_TENANT": "123456",
        "HORIZON_API_METRICS_OPEN": "yes",
        "HORIZON_API_DOCS": "True",
    }
    s = ApiSettings.from_env(env)
    assert fields_of(s) == {
        **DEFAULTS_BEFORE,
        # the file's keys, then HORIZON_API_KEYS's over them
        "api_keys": {"file-key-0123456789": "team-f", "both-key-0123456789": "from-env",
                     "env-key-0123456789": "team-e"},
        "jobs_root": tmp_path / "jobs", "uploads_dir": tmp_path / "up",
        "model_roots": [tmp_path / "m1", tmp_path / "m2"],
        "model_catalogue": {"tiny": tmp_path / "m1" / "tiny", "big": tmp_path / "m2" / "big"},
        "data_roots": [tmp_path / "d"],
        "tracker_hosts": ["mlflow.internal", "b.example"],
        "max_body_bytes": 2048, "max_upload_bytes": 4096, "max_upload_line_bytes": 512,
        "rate_limit_per_s": 2.5, "rate_limit_burst": 7, "max_streams_per_tenant": 3, "stream_poll_threads": 9,
        "max_uploads_in_flight": 5, "max_files_per_tenant": 11, "max_file_bytes_per_tenant": 123456,
        "metrics_open": True, "docs": True,
    }
    # an empty variable is an unset one; keyword overrides win over the environment
    s = ApiSettings.from_env({"HORIZON_RAY_HOME": "/h", "HORIZON_JOBS_ROOT": "", "HORIZON_API_MAX_BODY_BYTES": "",
                              "HORIZON_API_DOCS": "1"}, docs=False, max_streams_per_tenant=8)
    assert (s.jobs_root, s.max_body_bytes, s.docs, s.max_streams_per_tenant) == \
        (Path("/h/service/jobs"), 1048576, False, 8)
    for off in ("0", "false", "no", "off"):
        assert not ApiSettings.from_env({"HORIZON_API_METRICS_OPEN": off}).metrics_open


# ---- a bad value of each kind is refused naming its variable and the fix ----------------------------------


@pytest.mark.parametrize("env, words", [
    # an integer (a count)
    ({"HORIZON_API_MAX_UPLOADS_IN_FLIGHT": "two"},
     "HORIZON_API_MAX_UPLOADS_IN_FLIGHT='two' is not an integer; give a whole number of 1 or more"),
    ({"HORIZON_API_STREAM_POLL_THREADS": "0"},
     "HORIZON_API_STREAM_POLL_THREADS='0' is out of range; give a whole number of 1 or more"),
    ({"HORIZON_API_RATE_LIMIT_BURST": "2.5"}, "HORIZON_API_RATE_LIMIT_BURST='2.5' is not an integer"),
    # a size in bytes
    ({"HORIZON_API_MAX_UPLOAD_BYTES": "1GiB"},
     "HORIZON_API_MAX_UPLOAD_BYTES='1GiB' is not a number of bytes; give a positive integer, e.g. 1073741824"),
    ({"HORIZON_API_MAX_BODY_BYTES": "-5"}, "HORIZON_API_MAX_BODY_BYTES='-5' is out of range; give a positive integer"),
    ({"HORIZON_API_MAX_FILE_BYTES_PER_TENANT": "0"}, "HORIZON_API_MAX_FILE_BYTES_PER_TENANT='0' is out of range"),
    # a number
    ({"HORIZON_API_RATE_LIMIT_PER_S": "fast"}, "HORIZON_API_RATE_LIMIT_PER_S='fast' is not a number; give one >= 0"),
    ({"HORIZON_API_RATE_LIMIT_PER_S": "-1"}, "HORIZON_API_RATE_LIMIT_PER_S='-1' is out of range; give one >= 0"),
    # a yes or no (before: anything but 1/true/yes/on was silently "no")
    ({"HORIZON_API_DOCS": "maybe"}, "HORIZON_API_DOCS='maybe' is not a yes or no; give 1 or 0"),
    ({"HORIZON_API_METRICS_OPEN": "2"}, "HORIZON_API_METRICS_OPEN='2' is not a yes or no"),
    # a table of keys, of model names
    ({"HORIZON_API_KEYS": "just-a-key-0123456789"},
     "HORIZON_API_KEYS: entry 'just-a-key-0123456789' is not NAME=VALUE; write a=x,b=y"),
    ({"HORIZON_MODEL_CATALOGUE": "tiny"}, "HORIZON_MODEL_CATALOGUE: entry 'tiny' is not NAME=VALUE"),
    ({"HORIZON_MODEL_CATALOGUE": "m=/elsewhere/m", "HORIZON_MODEL_ROOTS": "/models"},
     "HORIZON_MODEL_CATALOGUE: m=/elsewhere/m lies under no model root (/models); add its parent directory to "
     "HORIZON_MODEL_ROOTS"),
    ({"HORIZON_API_KEYS": "k-0123456789abcdef=../etc"}, "tenant name '../etc' is not allowed"),
])
def test_a_bad_value_of_each_kind_is_refused_naming_its_variable(env, words):
    with pytest.raises(BadInput) as info:
        ApiSettings.from_env(env)
    assert words in info.value.message
    assert "validation error" not in info.value.message and "pydantic" not in info.value.message


@pytest.mark.parametrize("name, text, words", [
    ("keys.json", '{"keys": ', "HORIZON_API_KEYS_FILE={path}: cannot read it (JSONDecodeError"),
    ("keys.yaml", "- a\n- b\n", "HORIZON_API_KEYS_FILE={path}: expected a mapping of API key -> tenant name"),
    ("keys.json", '{"k-0123456789abcdef": 7}', "HORIZON_API_KEYS_FILE={path}: expected a mapping"),
    ("keys.yaml", "changeme-0123456789: team-a\n", "the API key of tenant 'team-a' is a placeholder"),
])
def test_a_bad_keys_file_is_refused_naming_its_variable(tmp_path, name, text, words):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(BadInput) as info:
        ApiSettings.from_env({"HORIZON_API_KEYS_FILE": str(path)})
    assert words.format(path=path) in info.value.message


def test_values_given_by_hand_are_checked_as_the_variables_are(tmp_path):
    with pytest.raises(BadInput, match="HORIZON_API_MAX_STREAMS_PER_TENANT=0 is out of range"):
        ApiSettings(max_streams_per_tenant=0)
    with pytest.raises(BadInput, match=r"sse_poll_s=0 is refused: Input should be greater than 0"):
        ApiSettings(sse_poll_s=0)
    with pytest.raises(BadInput, match="'max_stream_per_tenant' is not a setting; the settings are: api_keys, "):
        ApiSettings(max_stream_per_tenant=3)
    settings = ApiSettings(model_roots=[tmp_path / "m"])
    with pytest.raises(BadInput, match="lies under no model root"):  # a copy with changes is checked again
        settings.replaced(model_catalogue={"x": tmp_path / "elsewhere"})
    wider = settings.replaced(model_catalogue={"x": str(tmp_path / "m" / "x")})
    assert wider.model_catalogue == {"x": tmp_path / "m" / "x"} and settings.model_catalogue == {}


def test_only_from_env_reads_the_environment(monkeypatch):
    monkeypatch.setenv("HORIZON_API_DOCS", "1")
    monkeypatch.setenv("HORIZON_API_MAX_STREAMS_PER_TENANT", "3")
    monkeypatch.setenv("SSE_POLL_S", "9")  # a field no variable sets is not read by its name
    assert (ApiSettings().docs, ApiSettings().max_streams_per_tenant) == (False, 100)
    s = ApiSettings.from_env()
    assert (s.docs, s.max_streams_per_tenant, s.sse_poll_s) == (True, 3, 0.25)


# ---- the table is rendered from the fields ------------------------------------------------------------------


def test_the_table_is_rendered_from_the_fields():
    rows = {s.env: s for s in SETTINGS}
    for name, field in ApiSettings.model_fields.items():
        if field.validation_alias:
            assert rows[variable(name)].help == field.description
    assert settings_markdown().splitlines()[2] == (
        "| `HORIZON_API_KEYS` | none | " + ApiSettings.model_fields["api_keys"].description + " |")
    text = settings_text()
    assert all(f"  {s.env} (default {s.default})" in text for s in SETTINGS)


def test_serve_help_prints_the_table():
    import argparse

    from horizon_ray.commands import serve

    parser = argparse.ArgumentParser(prog="horizon-ray serve")
    serve.add_arguments(parser)
    assert settings_text() in parser.format_help()


def test_the_readme_table_is_the_one_the_fields_render():
    text = README.read_text()
    assert TABLE_BEGIN in text and TABLE_END in text, f"the README lost the settings table's markers {TABLE_BEGIN}"
    committed = text.split(TABLE_BEGIN + "\n", 1)[1].split(TABLE_END, 1)[0].rstrip("\n")
    assert committed == settings_markdown(), (
        "the README's settings table differs from the fields of api/settings.py; regenerate it: "
        "PYTHONPATH=. python -m api.settings --write-readme")


def test_write_readme_replaces_a_stale_table_and_keeps_the_rest():
    stale = f"# title\n\nbefore\n{TABLE_BEGIN}\n| variable | default | what it sets |\n| `OLD` | 1 | gone |\n" \
            f"{TABLE_END}\n\nafter\n"
    fresh = readme_with_table(stale)
    assert fresh == f"# title\n\nbefore\n{TABLE_BEGIN}\n{settings_markdown()}\n{TABLE_END}\n\nafter\n"
    assert readme_with_table(fresh) == fresh
    with pytest.raises(BadInput, match="no settings table between"):
        readme_with_table("# a README without the markers\n")
