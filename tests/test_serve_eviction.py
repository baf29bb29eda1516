"""At a connection limit the connection idle longest gives way: a kept-alive client between two
requests keeps its connection over half-header ones idle longer."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import wait_until
from tests.test_serve_connections import half_header_sockets, proxy_in_thread, read_until_closed
from vllm_aot.serve.connections import ConnectionLimits


@pytest.mark.unit
def test_a_kept_alive_client_between_requests_keeps_its_place_over_connections_idle_longer():
    limits = ConnectionLimits(max_connections=2, header_timeout=30)
    with (
        proxy_in_thread(limits=limits) as (url, proxy),
        httpx.Client(timeout=10) as client,
    ):
        assert client.post(f"{url}/v1/echo", content=b"1").status_code == 200  # opened first
        (idle,) = half_header_sockets(proxy.config.port, 1, "127.0.0.2")
        wait_until(lambda: proxy.guard.num_open == 2, 10, "the client and an idle connection")
        assert client.post(f"{url}/v1/echo", content=b"2").status_code == 200  # idle since now
        (newer,) = half_header_sockets(proxy.config.port, 1, "127.0.0.3")
        wait_until(lambda: read_until_closed(idle, {}), 10, "the one idle longest closed")
        assert proxy.guard.num_evicted == 1
        assert client.post(f"{url}/v1/echo", content=b"3").status_code == 200
        assert proxy.guard.num_evicted == 1  # on its kept-alive connection, nobody evicted
        for sock in (idle, newer):
            sock.close()
