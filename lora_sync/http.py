"""Minimal HTTP calls on the standard library: the trainer side needs no web framework, and a
push streams tensor memory straight into the socket."""
from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

from .errors import LoRASyncError, error_from_json


def _connection(url: str, timeout: float):
    u = urlsplit(url)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    return cls(u.hostname, u.port, timeout=timeout), u.path or "/"


def request(method: str, url: str, *, chunks=None, json_body=None, headers=None,
            timeout: float = 120.0) -> tuple[int, dict, dict]:
    """Sends a request; the body is either `json_body` or an iterable of byte chunks.
    Returns (status, reply JSON, reply headers)."""
    headers = dict(headers or {})
    if json_body is not None:
        chunks = [json.dumps(json_body).encode()]
        headers["Content-Type"] = "application/json"
    chunks = list(chunks or [])
    headers["Content-Length"] = str(sum(len(c) for c in chunks))
    conn, path = _connection(url, timeout)
    try:
        conn.putrequest(method, path)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        for c in chunks:
            conn.send(c)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            body = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            body = {"error": {"message": raw.decode(errors="replace")[:2000]}}
        return resp.status, body, dict(resp.getheaders())
    except (ConnectionError, OSError) as e:
        raise LoRASyncError(f"{method} {url} failed: {e}", code="unreachable", status=503) from e
    finally:
        conn.close()


def call(method: str, url: str, **kw) -> tuple[dict, dict]:
    """Like `request`, but raises the server's LoRASyncError on a non-2xx reply."""
    status, body, headers = request(method, url, **kw)
    if status >= 300:
        raise error_from_json(status, body if isinstance(body, dict) else {"error": body})
    return body, headers
