"""What `vllm-aot serve`'s proxy needs of vLLM's server: its CORS preflight answer, and a
replica key that every route of a replica requires.

CORS: the proxy answers preflights itself (never forwarded) with the answer vLLM's server gives,
Starlette's `CORSMiddleware` built from the same `--allowed-origins`, `--allowed-methods`,
`--allowed-headers` and `--allow-credentials`.

Replica key: replicas listen on loopback, where any local user can reach them. vLLM's own
`--api-key` guards only `/v1`, `/v2`, `/inference` and `/cohere` (not `/health`, `/metrics`,
`/tokenize`, `/invocations` ...), so each replica also runs `ReplicaKeyMiddleware` (vLLM's
`--middleware`), which refuses every request, any path and method, without the launch's
secret in `REPLICA_KEY_HEADER`; the secret comes from the environment (`REPLICA_KEY_ENV`), never
argv. The proxy adds it to what it forwards and to its scrapes, only ever to admitted replicas.

Admission proves the replica holds the key without sending it: the proxy's health check is
`GET /health` with a fresh nonce in `REPLICA_CHALLENGE_HEADER`, which the middleware lets through
and answers with `replica_proof(key, nonce)` (an HMAC) in `REPLICA_PROOF_HEADER`. A process that
took a restarting replica's port cannot answer it, so it is never admitted and never sees the
key or a client's request.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass

REPLICA_KEY_ENV = "VLLM_AOT_REPLICA_KEY"
REPLICA_KEY_HEADER = "X-Vllm-Aot-Replica-Key"
REPLICA_KEY_MIDDLEWARE = f"{__name__}.ReplicaKeyMiddleware"
REPLICA_CHALLENGE_HEADER = "X-Vllm-Aot-Replica-Challenge"
REPLICA_PROOF_HEADER = "X-Vllm-Aot-Replica-Proof"


@dataclass(frozen=True)
class CorsSettings:
    """vLLM's CORS flags (its defaults)."""

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    @classmethod
    def from_namespace(cls, namespace) -> CorsSettings:
        return cls(
            tuple(namespace.allowed_origins),
            tuple(namespace.allowed_methods),
            tuple(namespace.allowed_headers),
            bool(namespace.allow_credentials),
        )


def is_preflight(method: str, headers: Mapping[str, str]) -> bool:
    """A CORS preflight as Starlette tells one: OPTIONS with Origin and
    Access-Control-Request-Method."""
    return (
        method == "OPTIONS" and "Origin" in headers and "Access-Control-Request-Method" in headers
    )


def preflight_answer(
    cors: CorsSettings, headers: Mapping[str, str]
) -> tuple[int, dict[str, str], str]:
    """vLLM's answer to a preflight with `headers`: (status, headers, body text)."""
    from starlette.datastructures import Headers
    from starlette.middleware.cors import CORSMiddleware

    middleware = CORSMiddleware(
        app=None,
        allow_origins=cors.allowed_origins,
        allow_methods=cors.allowed_methods,
        allow_headers=cors.allowed_headers,
        allow_credentials=cors.allow_credentials,
    )
    lowered = {k.lower(): v for k, v in headers.items()}
    response = middleware.preflight_response(Headers(headers=lowered))
    kept = {
        k: v
        for k, v in response.headers.items()
        if k.lower() not in ("content-length", "content-type")
    }
    return response.status_code, kept, response.body.decode()


def replica_proof(key: str, nonce: str) -> str:
    """What a replica holding `key` answers to the challenge `nonce`."""
    return hmac.new(key.encode(), nonce.encode("latin-1"), hashlib.sha256).hexdigest()


def is_proof(key: str, nonce: str, proof: str | None) -> bool:
    return hmac.compare_digest(replica_proof(key, nonce).encode(), (proof or "").encode("latin-1"))


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


class ReplicaKeyMiddleware:
    """ASGI middleware: 401 for every HTTP or websocket request without the replica key, but a
    `GET /health` challenge, whose answer carries the proof."""

    def __init__(self, app) -> None:
        self.app = app
        key = os.environ.get(REPLICA_KEY_ENV)
        if not key:
            raise RuntimeError(f"{REPLICA_KEY_MIDDLEWARE} needs {REPLICA_KEY_ENV} set")
        self._key = key
        self._digest = _digest(key)

    def _header(self, scope, name: str) -> str | None:
        value = dict(scope.get("headers") or ()).get(name.lower().encode())
        return None if value is None else value.decode("latin-1")

    def _accepts(self, scope) -> bool:
        presented = self._header(scope, REPLICA_KEY_HEADER) or ""
        return hmac.compare_digest(_digest(presented), self._digest)

    async def _answer_challenge(self, nonce: str, scope, receive, send) -> None:
        proof = replica_proof(self._key, nonce).encode()

        async def send_with_proof(message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    *message.get("headers", ()),
                    (REPLICA_PROOF_HEADER.lower().encode(), proof),
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_proof)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self._accepts(scope):
            await self.app(scope, receive, send)
            return
        nonce = self._header(scope, REPLICA_CHALLENGE_HEADER)
        if nonce and (scope["type"], scope.get("method"), scope["path"]) == (
            "http",
            "GET",
            "/health",
        ):
            await self._answer_challenge(nonce, scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        from starlette.responses import JSONResponse

        await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
