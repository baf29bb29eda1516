"""The proxy's API-key check: every path is guarded except the proxy's own public handlers.

vLLM's `--api-key` guards only `/v1`, `/v2`, `/inference` and `/cohere`; `/invocations`,
`/tokenize`, `/pooling`, `/score`, `/start_profile` and the rest stay open. The proxy therefore
checks the key itself before anything reaches a replica, deny by default: a route is public only
when its handler is listed (`/health`; `/metrics` with `--expose-metrics`). The keys are those
vLLM takes from the same arguments, read by vLLM's own parser (`parse_vllm_flags`: `--config
FILE.yaml`, abbreviations such as `--api-k`), else `VLLM_API_KEY`.

A request passes with `Authorization: Bearer <one of the keys>`, compared in constant time (the
sha256 digests of the presented token and of every key, each compared, no early exit), so the
response time says nothing about a key. A refusal is vLLM's own: 401 `{"error": "Unauthorized"}`.
CORS preflights (OPTIONS with `Origin` and `Access-Control-Request-Method`, which browsers send
without credentials) are answered here as vLLM's server answers them, from the same CORS flags,
and never forwarded; any other OPTIONS request needs a key like every other method (vLLM mounts
its Prometheus app at `/metrics` for every method).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from aiohttp import web

from vllm_aot.plugin.server_guard import CorsSettings, is_preflight, preflight_answer

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


@dataclass(frozen=True)
class ApiKeys:
    """The accepted keys, held as sha256 digests only (so equal-length constant-time compares)."""

    digests: tuple[bytes, ...] = field(default=(), repr=False)

    @classmethod
    def of(cls, keys: Collection[str]) -> ApiKeys:
        return cls(tuple(_digest(k) for k in keys if k))

    @classmethod
    def from_vllm(cls, api_key: Sequence[str | None] | None, environ: Mapping[str, str]) -> ApiKeys:
        """The keys vLLM's server takes from its parsed --api-key (`VllmFlags.api_key`) and
        the environment: the flag's when given, else `VLLM_API_KEY`; empty ones skipped."""
        return cls.of([k for k in (api_key or [environ.get("VLLM_API_KEY")]) if k])

    @property
    def is_required(self) -> bool:
        return bool(self.digests)

    def accepts(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header value carries one of the keys as a Bearer token."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        presented = _digest(token)
        is_match = False
        for digest in self.digests:
            is_match |= hmac.compare_digest(presented, digest)
        return is_match


def unauthorized() -> web.Response:
    return web.json_response(
        {"error": "Unauthorized"}, status=401, headers={"WWW-Authenticate": "Bearer"}
    )


def authentication(keys: ApiKeys, public: Collection[Handler]):
    """aiohttp middleware: 401 for any request without a key unless its handler is `public`."""

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        is_public = request.match_info.handler in public
        if is_public or keys.accepts(request.headers.get("Authorization")):
            return await handler(request)
        return unauthorized()

    return authenticate


def cors_preflights(cors: CorsSettings):
    """aiohttp middleware: answer CORS preflights as vLLM would; nothing is forwarded."""

    @web.middleware
    async def answer(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not is_preflight(request.method, request.headers):
            return await handler(request)
        status, headers, text = preflight_answer(cors, request.headers)
        return web.Response(status=status, headers=headers, text=text)

    return answer
