"""The client's request body on the socket (lora_sync/http.py `_send_body`): every byte of
every chunk, in order, whatever the kernel takes per sendmsg, over plain TCP and over TLS
(which has no sendmsg)."""
from __future__ import annotations

import random
import shutil
import socket
import ssl
import subprocess
import threading
import time

import pytest
import torch

from lora_sync import http, wire


def _chunks(seed: int) -> list:
    """Bytes, bytearrays, empty chunks, tensor views (wire.as_bytes, bf16 included) and
    one chunk of several MB, which a small send buffer takes in many partial sends."""
    rng = random.Random(seed)
    out = []
    for i in range(300):
        kind = rng.randrange(4)
        n = rng.choice([0, 1, 7, 64, 4096, 70_001])
        if kind == 0:
            out.append(rng.randbytes(n))
        elif kind == 1:
            out.append(bytearray(rng.randbytes(n)))
        elif kind == 2:
            dtype = rng.choice([torch.float32, torch.bfloat16])
            out.append(wire.as_bytes(torch.randn(n // 4 + 1, generator=torch.Generator()
                                                  .manual_seed(i)).to(dtype)))
        else:
            out.append(memoryview(rng.randbytes(n)))
    out.insert(rng.randrange(len(out)), rng.randbytes(5 << 20))
    return out


def _read_all(sock: socket.socket, into: list) -> None:
    while data := sock.recv(1 << 16):
        into.append(data)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("as_iterator", [False, True])
def test_every_chunk_arrives_whole_and_in_order(seed, as_iterator):
    chunks = _chunks(seed)
    sender, receiver = socket.socketpair()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # many partial sends
    got: list = []
    reader = threading.Thread(target=_read_all, args=(receiver, got))
    reader.start()
    with sender, receiver:
        http._send_body(sender, iter(chunks) if as_iterator else chunks,
                        time.monotonic() + 60)
        sender.shutdown(socket.SHUT_WR)
        reader.join(timeout=60)
    assert b"".join(got) == b"".join(bytes(c) for c in chunks)


def test_a_tls_socket_gets_every_chunk(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))
    listener = socket.create_server(("127.0.0.1", 0))
    got: list = []

    def serve():
        conn, _ = listener.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            _read_all(tls, got)
    server = threading.Thread(target=serve)
    server.start()
    chunks = _chunks(2)
    with listener, socket.create_connection(listener.getsockname()) as raw, \
            client_ctx.wrap_socket(raw, server_hostname="localhost") as tls:
        http._send_body(tls, chunks, time.monotonic() + 60)
        # a half close: a full one with the server's session tickets unread resets the link
        tls.shutdown(socket.SHUT_WR)
        server.join(timeout=60)
    assert b"".join(got) == b"".join(bytes(c) for c in chunks)
