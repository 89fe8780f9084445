"""HTTP/1.1 by hand, for what a well-behaved client library will not send: lying lengths,
dripped bytes, odd paths and Host headers, oversized heads."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(slots=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict:
        """The OpenAI error object the body must be."""
        return json.loads(self.body)["error"]


def connect(url: str, timeout: float = 30) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout)


def head(method: str, path: str, headers: dict[str, str] | None = None, host: str = "x") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_reply(sock: socket.socket, head_only: bool = False) -> Reply:
    """One response (by Content-Length, else until the server closes); a reply to a HEAD
    (``head_only``) has a Content-Length and no body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a full response head: {data[:200]!r}")
        data += chunk
    raw_head, body = data.split(b"\r\n\r\n", 1)
    lines = raw_head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = 0 if head_only else int(headers.get("content-length", -1))
    while length < 0 or len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return Reply(int(lines[0].split()[1]), headers, body)


def exchange(url: str, data: bytes, timeout: float = 30) -> Reply:
    """Send ``data`` as is and read the reply."""
    with connect(url, timeout) as sock:
        sock.sendall(data)
        return read_reply(sock, head_only=data.startswith(b"HEAD "))


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed its side (EOF or reset)."""
    try:
        return sock.recv(65536) == b""
    except ConnectionError:
        return True
