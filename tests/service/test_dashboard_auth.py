"""Dashboard sessions in-process (TestClient over https): cookie flags, CSRF, revocation, redirects,
tenancy of pages, and cancel through the dashboard."""
from __future__ import annotations

import re

import pytest
from sqlalchemy import update

from service.db import utcnow
from service.jobs.schemas import JobCreate
from service.jobs.service import create as create_job
from service.models.tables import ModelRecord
from service.tenants.service import find_tenant
from service.tenants.tables import ApiKey
from tests.service.conftest import two_tenant_app


@pytest.fixture
def site(settings):
    with two_tenant_app(settings, base_url="https://testserver") as (client, db, keys, dispatcher):
        yield client, db, keys, dispatcher


def csrf_of(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def sign_in(client, key: str, next_path: str = "/jobs"):
    form = client.get("/signin")
    return client.post("/signin", data={"csrf": csrf_of(form.text), "api_key": key,
                                        "next": next_path}, follow_redirects=False)


def test_session_cookie_flags_and_v1_stays_on_bearer_keys(site):
    client, _db, keys, _ = site
    reply = sign_in(client, keys["acme"])
    assert reply.status_code == 303 and reply.headers["location"] == "/jobs"
    cookie = next(c for c in reply.headers.get_list("set-cookie") if c.startswith("kiln_session="))
    assert all(flag in cookie for flag in ("HttpOnly", "Secure", "SameSite=strict"))
    assert keys["acme"] not in cookie
    page = client.get("/jobs")
    assert page.status_code == 200 and "acme" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert client.get("/v1/jobs").status_code == 401  # the cookie is not an API key


def test_sign_in_needs_its_csrf_token_and_never_redirects_off_site(site):
    client, _db, keys, _ = site
    client.get("/signin")
    refused = client.post("/signin", data={"csrf": "forged", "api_key": keys["acme"]})
    assert refused.status_code == 403
    assert sign_in(client, keys["acme"], "//evil.example/x").headers["location"] == "/jobs"
    assert sign_in(client, "kiln_nope_nope").status_code == 401


def test_cancel_needs_the_sessions_csrf_token(site):
    client, db, keys, dispatcher = site
    sign_in(client, keys["acme"])
    tenant = find_tenant(db, "acme").id
    with db.write() as s:
        s.add(ModelRecord(id="m1", tenant_id=tenant, sha256="0" * 64, size_bytes=1,
                          filename="<b>m</b>.onnx", opset=14, inputs=[]))
    job = create_job(db, tenant, JobCreate(model_id="m1"))
    page = client.get("/jobs")
    assert "&lt;b&gt;m&lt;/b&gt;.onnx" in page.text and "<b>m</b>" not in page.text
    assert client.post(f"/jobs/{job.id}/cancel", data={"csrf": "forged"}).status_code == 403
    done = client.post(f"/jobs/{job.id}/cancel", data={"csrf": csrf_of(page.text)},
                       follow_redirects=False)
    assert done.status_code == 303 and dispatcher.revoked == [job.id]
    assert "cancelled" in client.get(f"/jobs/{job.id}").text


def test_another_tenants_job_page_is_not_found_and_revoking_the_key_ends_the_session(site):
    client, db, keys, _ = site
    sign_in(client, keys["globex"])
    tenant = find_tenant(db, "acme").id
    with db.write() as s:
        s.add(ModelRecord(id="m2", tenant_id=tenant, sha256="1" * 64, size_bytes=1,
                          filename="m.onnx", opset=14, inputs=[]))
    job = create_job(db, tenant, JobCreate(model_id="m2"))
    assert client.get(f"/jobs/{job.id}").status_code == 404
    assert client.get("/jobs").status_code == 200
    with db.write() as s:
        s.execute(update(ApiKey).values(revoked_at=utcnow()))
    gone = client.get("/jobs", follow_redirects=False)
    assert gone.status_code == 303 and gone.headers["location"].startswith("/signin")


def test_sign_out_ends_the_session(site):
    client, _db, keys, _ = site
    sign_in(client, keys["acme"])
    page = client.get("/jobs")
    out = client.post("/signout", data={"csrf": csrf_of(page.text)}, follow_redirects=False)
    assert out.status_code == 303
    assert client.get("/jobs", follow_redirects=False).status_code == 303


def test_upload_needs_the_csrf_header_and_takes_shapes_for_symbolic_inputs(site):
    import io

    import onnx

    from tests.service.conftest import add_model

    client, _db, keys, dispatcher = site
    sign_in(client, keys["acme"])
    csrf = csrf_of(client.get("/jobs").text)
    data = io.BytesIO()
    onnx.save(add_model(symbolic=True), data)
    body = data.getvalue()
    raw = {"Content-Type": "application/octet-stream"}
    assert client.post("/jobs/upload?filename=m.onnx", content=body, headers=raw).status_code == 403
    headers = raw | {"X-CSRF-Token": csrf}
    missing = client.post("/jobs/upload?filename=m.onnx", content=body, headers=headers)
    assert missing.status_code == 422 and "'x' has symbolic dimension" in missing.json()["detail"]
    bad = client.post("/jobs/upload", params={"shapes": "x=two"}, content=body, headers=headers)
    assert bad.status_code == 422 and "shapes expects NAME=D0,D1" in bad.json()["detail"]
    made = client.post("/jobs/upload", params={"filename": "m.onnx", "shapes": "x=3,4"},
                       content=body, headers=headers)
    assert made.status_code == 201, made.text
    job = client.get(f"/v1/jobs/{made.json()['job_id']}",
                     headers={"Authorization": f"Bearer {keys['acme']}"}).json()
    assert job["shapes"] == {"x": [3, 4]} and dispatcher.enqueued == [job["id"]]
