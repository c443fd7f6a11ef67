"""The API's settings: their defaults and variables as they were before pydantic-settings (the literals below are
what api/settings.py gave at 810280c), the refusal of a bad value of each kind naming its variable, and the
README's table against the one the fields render."""

import os
from pathlib import Path

from api.settings import SETTINGS, ApiSettings

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
    assert [(s.env, s.default) for s in SETTINGS] == TABLE_BEFORE


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
