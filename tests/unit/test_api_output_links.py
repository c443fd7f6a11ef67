"""A job's outputs are served only from the tenant's own namespace as a plain directory: `<jobs_root>/<tenant>`
planted as a link to another tenant's opens nothing (it served the other tenant's files), and a file of final/
with a second name (a hard link, which may be a file from anywhere) is neither listed, served nor put in the
tar. In-process, over the testbed."""

from __future__ import annotations

import io
import os
import shutil
import tarfile

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.testing import make_testbed


@pytest.fixture
def bed(tmp_path):
    bed = make_testbed(tmp_path)
    yield bed
    bed.close()


def submit(http, bed, tenant, output_dir):
    r = http.post("/finetune", json={**bed.spec(), "output_dir": output_dir}, headers=bed.auth(tenant))
    assert r.status_code == 201, r.text
    return r.json()


def write_final(output_dir: str, files: dict[str, bytes]) -> None:
    final = os.path.join(output_dir, "final")
    os.makedirs(final, exist_ok=True)
    for name, data in files.items():
        with open(os.path.join(final, name), "wb") as f:
            f.write(data)


def test_a_tenants_namespace_planted_as_a_link_serves_nothing(bed):
    with TestClient(create_app(bed.client, bed.settings), raise_server_exceptions=False) as http:
        theirs = submit(http, bed, "globex", "shared")
        mine = submit(http, bed, "acme", "shared")  # the same name in acme's own namespace
        write_final(theirs["result"]["output_dir"], {"config.json": b'{"secret": "globex"}'})
        acme_root = bed.settings.outputs_dir("acme")
        shutil.rmtree(acme_root, ignore_errors=True)  # the fake engines wrote nothing there
        os.symlink(bed.settings.outputs_dir("globex"), acme_root)  # acme's namespace now leads to globex's
        auth = bed.auth("acme")
        assert http.get(f"/finetune/{mine['id']}/outputs", headers=auth).json()["data"] == []
        for path in ("final/config.json", "final.tar"):
            r = http.get(f"/finetune/{mine['id']}/outputs/{path}", headers=auth)
            assert r.status_code == 404 and "globex" not in r.text, (path, r.text)
        r = http.post("/finetune", json={**bed.spec(), "output_dir": "other"}, headers=auth)
        assert r.status_code == 422 and r.json()["error"]["field"] == "output_dir", r.text
        # globex's own reads are unchanged
        r = http.get(f"/finetune/{theirs['id']}/outputs/final/config.json", headers=bed.auth("globex"))
        assert r.status_code == 200 and r.content == b'{"secret": "globex"}'


def test_a_hard_link_in_final_is_not_served(bed, tmp_path):
    secret = tmp_path / "elsewhere.key"
    secret.write_bytes(b"not an output")
    with TestClient(create_app(bed.client, bed.settings), raise_server_exceptions=False) as http:
        job = submit(http, bed, "acme", "run")
        out = job["result"]["output_dir"]
        write_final(out, {"config.json": b"{}"})
        os.link(secret, os.path.join(out, "final", "stolen.key"))  # a second name of a file from elsewhere
        auth = bed.auth("acme")
        listed = [f["path"] for f in http.get(f"/finetune/{job['id']}/outputs", headers=auth).json()["data"]]
        assert listed == ["final/config.json"]
        assert http.get(f"/finetune/{job['id']}/outputs/final/stolen.key", headers=auth).status_code == 404
        assert http.get(f"/finetune/{job['id']}/outputs/final/config.json", headers=auth).content == b"{}"
        tar = tarfile.open(fileobj=io.BytesIO(http.get(f"/finetune/{job['id']}/outputs/final.tar",
                                                       headers=auth).content))
        assert sorted(m.name for m in tar.getmembers()) == [f"{job['id']}-final", f"{job['id']}-final/config.json"]
