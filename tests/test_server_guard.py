"""The replica key inside vLLM's server: vLLM's `--middleware` installs `ReplicaKeyMiddleware`,
which refuses every route and method without the key, `/health` and `/metrics` included (vLLM's
own `--api-key` guards only `/v1`, `/v2`, `/inference` and `/cohere`)."""

from __future__ import annotations

import pytest

from vllm_aot.plugin.engine_flags import serve_parser
from vllm_aot.plugin.server_guard import (
    REPLICA_CHALLENGE_HEADER,
    REPLICA_KEY_ENV,
    REPLICA_KEY_HEADER,
    REPLICA_KEY_MIDDLEWARE,
    REPLICA_PROOF_HEADER,
    CorsSettings,
    is_proof,
    preflight_answer,
)

pytestmark = pytest.mark.unit


def test_vllm_installs_the_replica_key_on_every_route(monkeypatch):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware

    monkeypatch.setenv(REPLICA_KEY_ENV, "rk")
    args = serve_parser().parse_args(["serve", "m", "--middleware", REPLICA_KEY_MIDDLEWARE])
    app = FastAPI()
    for path in ("/health", "/tokenize", "/v1/models"):
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET", "POST", "OPTIONS"])
    metrics = FastAPI()
    metrics.add_api_route("/", lambda: "series", methods=["GET", "OPTIONS"])
    app.mount("/metrics", metrics)
    init_entrypoints_middleware(args, app, ())
    client = TestClient(app)
    for method, path in [("GET", "/health"), ("POST", "/tokenize"), ("GET", "/v1/models"),
                         ("GET", "/metrics/"), ("OPTIONS", "/metrics/")]:  # fmt: skip
        response = client.request(method, path)
        assert (response.status_code, response.json()) == (401, {"error": "Unauthorized"})
        wrong = client.request(method, path, headers={REPLICA_KEY_HEADER: "other"})
        assert wrong.status_code == 401
        assert client.request(method, path, headers={REPLICA_KEY_HEADER: "rk"}).status_code == 200
    # The proxy's health check: a challenge, answered with the proof, no key sent.
    challenge = {REPLICA_CHALLENGE_HEADER: "nonce-1"}
    response = client.get("/health", headers=challenge)
    assert response.status_code == 200
    assert is_proof("rk", "nonce-1", response.headers[REPLICA_PROOF_HEADER])
    assert not is_proof("other", "nonce-1", response.headers[REPLICA_PROOF_HEADER])
    assert not is_proof("rk", "nonce-2", response.headers[REPLICA_PROOF_HEADER])
    assert client.post("/health", headers=challenge).status_code == 401
    assert client.get("/tokenize", headers=challenge).status_code == 401
    assert client.get("/metrics/", headers=challenge).status_code == 401


def test_a_replica_without_its_key_refuses_to_start(monkeypatch):
    from vllm_aot.plugin.server_guard import ReplicaKeyMiddleware

    monkeypatch.delenv(REPLICA_KEY_ENV, raising=False)
    with pytest.raises(RuntimeError, match=REPLICA_KEY_ENV):
        ReplicaKeyMiddleware(app=None)


def test_preflights_are_answered_as_vllms_cors_settings_say():
    asked = {"Origin": "https://a.example", "Access-Control-Request-Method": "PUT"}
    status, headers, _ = preflight_answer(CorsSettings(), asked)  # vLLM's default: no origin
    assert status == 400 and "access-control-allow-origin" not in headers
    cors = CorsSettings(("https://a.example",), ("GET", "POST"), ("*",), True)
    status, headers, text = preflight_answer(cors, asked)
    assert (status, text) == (400, "Disallowed CORS method")
    status, headers, text = preflight_answer(
        cors, {**asked, "Access-Control-Request-Method": "POST"}
    )
    assert (status, text) == (200, "OK")
    assert headers["access-control-allow-origin"] == "https://a.example"
    assert headers["access-control-allow-credentials"] == "true"
