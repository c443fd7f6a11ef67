"""A job's outputs as the API lists and serves them: the engine's bookkeeping (.lock, .lease, .lease.lock) and
writes in progress are not outputs; loss_curve.png comes as an image the browser shows."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from api.app import create_app
from api.testing import make_testbed


def test_outputs_leave_out_bookkeeping_and_serve_images_as_images(tmp_path):
    bed = make_testbed(tmp_path)
    with TestClient(create_app(bed.client, bed.settings)) as http:
        r = http.post("/finetune", json=bed.spec(), headers=bed.auth("acme"))
        assert r.status_code == 201, r.text
        out = Path(bed.client.get("acme", r.json()["id"]).output_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name in (".lock", ".lease", ".lease.lock", "final.tmp-123/model.safetensors", "metrics.jsonl",
                     "loss_curve.png", "final/config.json", "job.yaml"):
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(b"\x89PNG\r\n" if name.endswith(".png") else b"{}\n")
        base = f"/finetune/{r.json()['id']}/outputs"
        listed = [f["path"] for f in http.get(base, headers=bed.auth("acme")).json()["data"]]
        assert sorted(listed) == ["final/config.json", "job.yaml", "loss_curve.png", "metrics.jsonl"]
        png = http.get(f"{base}/loss_curve.png", headers=bed.auth("acme"))
        assert png.status_code == 200 and png.headers["content-type"] == "image/png"
        assert png.headers["content-disposition"].startswith("inline")
        assert http.get(f"{base}/final/config.json", headers=bed.auth("acme")).headers["content-type"] == \
            "application/json"
        for hidden in (".lease", ".lock", "final.tmp-123/model.safetensors"):
            assert http.get(f"{base}/{hidden}", headers=bed.auth("acme")).status_code == 404, hidden
    bed.close()
