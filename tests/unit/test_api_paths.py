"""API settings and path confinement: what a tenant's spec may read and where its outputs may go."""

import os

import pytest

from api.errors import ApiError
from api.paths import PathPolicy, confine_spec
from api.settings import ApiSettings, load_api_keys_file, parse_api_keys


@pytest.fixture
def roots(tmp_path):
    models, data = tmp_path / "models", tmp_path / "data"
    (models / "tiny").mkdir(parents=True)
    (models / "tiny" / "config.json").write_text("{}")
    data.mkdir()
    (data / "train.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "secret.jsonl").write_text('{"text": "secret"}\n')
    settings = ApiSettings(
        api_keys={"k1": "acme", "k2": "globex"},
        uploads_dir=tmp_path / "uploads",
        jobs_root=tmp_path / "jobs",
        data_roots=[data],
        model_roots=[models],
        model_catalogue={"tiny-llama": models / "tiny"},
    )
    return tmp_path, settings


def refused(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    assert info.value.status == 422
    return info.value


def test_parse_api_keys_env_format():
    assert parse_api_keys("key1=tenant-a, key2=tenant-b,") == {"key1": "tenant-a", "key2": "tenant-b"}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_api_keys("key1")


def test_settings_from_env_and_keys_file(tmp_path):
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text("keys:\n  filekey: tenant-f\n")
    assert load_api_keys_file(keys_file) == {"filekey": "tenant-f"}
    env = {"HORIZON_API_KEYS": "k=tenant-e", "HORIZON_API_KEYS_FILE": str(keys_file),
           "HORIZON_DATA_ROOTS": f"{tmp_path}/d1{os.pathsep}{tmp_path}/d2", "HORIZON_API_MAX_BODY_BYTES": "2048",
           "HORIZON_MODEL_CATALOGUE": f"tiny={tmp_path}/m/tiny", "HORIZON_MODEL_ROOTS": f"{tmp_path}/m"}
    s = ApiSettings.from_env(env)
    assert s.api_keys == {"filekey": "tenant-f", "k": "tenant-e"}
    assert s.data_roots == [tmp_path / "d1", tmp_path / "d2"]
    assert s.max_body_bytes == 2048
    assert s.model_catalogue == {"tiny": tmp_path / "m" / "tiny"}


@pytest.mark.parametrize("key", ["replace-me-with-a-random-key-for-team-a", "CHANGEME", "your-api-key-here",
                                 "example-key-0001"])
def test_placeholder_api_keys_are_refused(tmp_path, key):
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(f"keys:\n  {key}: team-a\n")
    with pytest.raises(ValueError, match="API key of tenant 'team-a' is a placeholder.*HORIZON_API_KEYS_FILE"):
        ApiSettings.from_env({"HORIZON_API_KEYS_FILE": str(keys_file)})
    assert ApiSettings(api_keys={"4dbd0a5f0f6b4a4c9d41c0a0e8c2b7f1": "team-a"}).api_keys  # a random key is fine


def test_the_limits_have_safe_defaults_and_come_from_their_variables():
    s = ApiSettings()
    assert s.rate_limit_per_s > 0 and s.max_streams_per_tenant > 0 and s.max_uploads_in_flight > 0
    assert s.max_files_per_tenant > 0 and s.max_file_bytes_per_tenant > 0 and not s.docs
    s = ApiSettings.from_env({"HORIZON_API_RATE_LIMIT_PER_S": "0", "HORIZON_API_MAX_STREAMS_PER_TENANT": "7",
                              "HORIZON_API_MAX_FILE_BYTES_PER_TENANT": "1000", "HORIZON_API_DOCS": "1"})
    assert (s.rate_limit_per_s, s.max_streams_per_tenant, s.max_file_bytes_per_tenant, s.docs) == (0, 7, 1000, True)
    with pytest.raises(ValueError, match="HORIZON_API_MAX_UPLOADS_IN_FLIGHT='two' is not an integer"):
        ApiSettings.from_env({"HORIZON_API_MAX_UPLOADS_IN_FLIGHT": "two"})
    with pytest.raises(ValueError, match="HORIZON_API_MAX_STREAMS_PER_TENANT=0 is out of range; give a whole"):
        ApiSettings(max_streams_per_tenant=0)


@pytest.mark.parametrize("tenant", ["../etc", "a/b", "", "x" * 65, ".hidden"])
def test_tenant_names_that_are_not_directory_safe_are_refused(tenant):
    with pytest.raises(ValueError, match="tenant name"):
        ApiSettings(api_keys={"k": tenant})


def test_names_relative_to_roots_resolve(roots):
    tmp, settings = roots
    policy = PathPolicy(settings, "acme")
    assert policy.model("model.path", "tiny") == str(tmp / "models" / "tiny")
    assert policy.model("model.path", "tiny-llama") == str(tmp / "models" / "tiny")
    assert policy.model("model.path", str(tmp / "models" / "tiny")) == str(tmp / "models" / "tiny")
    assert policy.dataset("data.path", "train.jsonl") == str(tmp / "data" / "train.jsonl")


@pytest.mark.parametrize("value", ["/etc", "../secret.jsonl", "~/x.jsonl", "a/../../secret.jsonl", "/"])
def test_paths_outside_roots_are_refused(roots, value):
    _, settings = roots
    policy = PathPolicy(settings, "acme")
    err = refused(policy.dataset, "data.path", value)
    assert err.field == "data.path"
    assert err.code == "path_not_allowed"


def test_absolute_path_outside_roots_is_refused_even_when_it_exists(roots):
    tmp, settings = roots
    err = refused(PathPolicy(settings, "acme").dataset, "data.path", str(tmp / "secret.jsonl"))
    assert "outside" in err.message


def test_symlink_out_of_a_root_is_refused(roots):
    tmp, settings = roots
    (tmp / "data" / "escape.jsonl").symlink_to(tmp / "secret.jsonl")
    (tmp / "models" / "escape").symlink_to(tmp)
    policy = PathPolicy(settings, "acme")
    assert "symlink" in refused(policy.dataset, "data.path", "escape.jsonl").message
    assert "symlink" in refused(policy.model, "model.path", "escape").message


def test_missing_names_are_a_422_naming_the_field(roots):
    _, settings = roots
    err = refused(PathPolicy(settings, "acme").dataset, "data.eval_path", "nope.jsonl")
    assert (err.code, err.field) == ("path_not_found", "data.eval_path")


def test_a_root_that_contains_the_namespaces_never_opens_another_tenants_files(roots):
    tmp, settings = roots
    theirs = settings.files_dir("globex") / "file-000000000000000000000000.jsonl"
    theirs.parent.mkdir(parents=True)
    theirs.write_text('{"text": "theirs"}\n')
    mine = settings.files_dir("acme") / "mine.jsonl"
    mine.parent.mkdir(parents=True)
    mine.write_text('{"text": "mine"}\n')
    wide = ApiSettings(api_keys=settings.api_keys, uploads_dir=settings.uploads_dir, jobs_root=settings.jobs_root,
                       data_roots=[tmp])
    policy = PathPolicy(wide, "acme")
    assert "another tenant" in refused(policy.dataset, "data.path", str(theirs)).message
    assert "another tenant" in refused(policy.dataset, "data.path",
                                       "uploads/globex/file-000000000000000000000000.jsonl").message
    assert policy.dataset("data.path", "uploads/acme/mine.jsonl") == str(mine)


def test_uploaded_file_ids_resolve_only_in_the_owners_namespace(roots):
    _, settings = roots
    fid = "file-0123456789abcdef01234567"
    path = settings.files_dir("acme") / f"{fid}.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text('{"text": "x"}\n')
    assert PathPolicy(settings, "acme").dataset("data.path", fid) == str(path)
    assert refused(PathPolicy(settings, "globex").dataset, "data.path", fid).code == "file_not_found"


def test_an_upload_is_read_in_the_format_it_was_checked_in_and_keeps_examples_to_train_on(roots):
    import json

    _, settings = roots
    files = settings.files_dir("acme")
    files.mkdir(parents=True)
    ids = {}
    for i, (name, fmt, n) in enumerate((("text", "text", 40), ("alpaca", "alpaca", 40), ("one", "text", 1))):
        fid = ids[name] = f"file-{i:024x}"
        (files / f"{fid}.jsonl").write_text('{"text": "x"}\n' * n)
        (files / f"{fid}.json").write_text(json.dumps({"id": fid, "format": fmt, "num_examples": n}))
    policy = PathPolicy(settings, "acme")

    def spec(**data):
        return {"model": {"path": "tiny"}, "data": data}

    assert confine_spec(spec(path=ids["text"]), policy)["data"]["format"] == "text"  # auto takes the upload's
    err = refused(confine_spec, spec(path=ids["text"], format="alpaca"), policy)
    assert err.field == "data.format" and "was checked as 'text'" in err.message
    err = refused(confine_spec, spec(path=ids["text"], eval_path=ids["alpaca"]), policy)
    assert err.field == "data.eval_path"
    err = refused(confine_spec, spec(path=ids["one"]), policy)  # the default 5 % holds out its only example
    assert err.field == "data.eval_fraction" and "leaves nothing to train on" in err.message
    assert confine_spec(spec(path=ids["one"], eval_fraction=0), policy)["data"]["path"].endswith(".jsonl")


def test_confine_spec_rewrites_paths_and_confines_output_dir(roots):
    tmp, settings = roots
    spec = {"model": {"path": "tiny"}, "data": {"path": "train.jsonl"}, "training": {"max_steps": 1}}
    out = confine_spec(spec, PathPolicy(settings, "acme"))
    assert out["model"]["path"] == str(tmp / "models" / "tiny")
    assert out["data"]["path"] == str(tmp / "data" / "train.jsonl")
    assert "output_dir" not in out  # the coordinator names one per job
    assert spec["model"]["path"] == "tiny"  # the caller's dict is left alone
    named = confine_spec({**spec, "output_dir": "runs/first"}, PathPolicy(settings, "acme"))
    assert named["output_dir"] == str(settings.outputs_dir("acme") / "runs" / "first")
    for bad in ("/tmp/elsewhere", "../globex/x", "~/x"):
        err = refused(confine_spec, {**spec, "output_dir": bad}, PathPolicy(settings, "acme"))
        assert err.field == "output_dir"


def test_confine_spec_requires_model_and_data(roots):
    _, settings = roots
    err = refused(confine_spec, {"data": {"path": "train.jsonl"}}, PathPolicy(settings, "acme"))
    assert err.field == "model.path"
    err = refused(confine_spec, {"model": {"path": "tiny"}, "data": "x"}, PathPolicy(settings, "acme"))
    assert err.field == "data"
