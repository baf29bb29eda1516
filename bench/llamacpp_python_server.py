"""llama-cpp-python's OpenAI server for bench/perf_bench.py, without the `X-Request-ID` header.

Runs under `.venv-llamacpp/bin/python` (scripts/setup_llamacpp.sh), never the project's venv.
`vllm bench serve` sends `X-Request-ID: <prefix><n>` with every request and has no flag against
it; the server's request-id middleware takes only UUIDs and answers anything else with HTTP 400,
and has no option either. So the server's own app (what `python -m llama_cpp.server` builds) is
wrapped in a small ASGI layer that drops that one header; everything else is unchanged. Its
settings follow docs/benchmarking.md: no request interruption, no SSE ping events.

    .venv-llamacpp/bin/python bench/llamacpp_python_server.py MODEL.gguf --port 8000
"""

from __future__ import annotations

import argparse

import uvicorn
from llama_cpp.server.app import create_app
from llama_cpp.server.settings import ModelSettings, ServerSettings


def without_request_id(app):
    async def app_without_request_id(scope, receive, send):
        if scope["type"] == "http":
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"x-request-id"]
            scope = {**scope, "headers": headers}
        await app(scope, receive, send)

    return app_without_request_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("--alias", default=None, help="the model name clients send")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--threads", type=int, default=-1, help="default: all CPUs")
    parser.add_argument("--ctx-size", type=int, default=2048)
    args = parser.parse_args()
    server = ServerSettings(
        host="127.0.0.1", port=args.port, interrupt_requests=False, disable_ping_events=True
    )
    model = ModelSettings(
        model=args.model,
        model_alias=args.alias,
        n_ctx=args.ctx_size,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        verbose=False,
    )
    app = create_app(server_settings=server, model_settings=[model])
    uvicorn.run(without_request_id(app), host=server.host, port=server.port, log_level="warning")


if __name__ == "__main__":
    main()
