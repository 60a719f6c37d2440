"""A raw HTTP/1.1 client for the bookie admin endpoint (tests control every byte sent).

``http_get(host, port, "/health")`` and ``http_raw(host, port, b"garbage\\r\\n\\r\\n")`` return
``(status, headers, body)``; ``scrape`` parses ``/metrics`` with prometheus_client.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Response = tuple[int, dict[str, str], bytes]


async def http_raw(host: str, port: int, request: bytes, timeout_s: float = 10.0) -> Response:
    """Send ``request`` as is (then EOF), read until the server closes, parse the response."""
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(request)
            writer.write_eof()  # nothing more will come: a truncated request is answered, not timed out
            await writer.drain()
            data = await reader.read()
        finally:
            writer.close()
    return parse_response(data)


async def http_get(
    host: str, port: int, path: str, method: str = "GET", token: bytes | str | None = None
) -> Response:
    auth = ""
    if token is not None:
        auth = f"Authorization: Bearer {token.decode() if isinstance(token, bytes) else token}\r\n"
    return await http_raw(host, port, f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{auth}\r\n".encode())


async def post_json(host: str, port: int, path: str, token: bytes | str) -> tuple[int, Any]:
    """A state change: ``POST path`` with the admin token."""
    status, _, body = await http_get(host, port, path, "POST", token)
    return status, json.loads(body) if status == 200 else body


async def get_json(host: str, port: int, path: str) -> tuple[int, Any]:
    status, _, body = await http_get(host, port, path)
    return status, json.loads(body)


async def scrape(host: str, port: int) -> dict[str, float]:
    """``/metrics`` as ``{'name{k="v"}': value}`` (labels sorted), parsed by prometheus_client."""
    status, _, body = await http_get(host, port, "/metrics")
    assert status == 200, body
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def parse_response(data: bytes) -> Response:
    if not data:
        raise ConnectionError("the server closed without a response")
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("ascii").split("\r\n")
    version, status, _ = lines[0].split(" ", 2)
    assert version == "HTTP/1.1", lines[0]
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        assert len(body) == int(headers["content-length"]) or not body, (len(body), headers)
    return int(status), headers, body
