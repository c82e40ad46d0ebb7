"""The trainer of tests/test_multihost.py, run inside its own network namespace (host).

Usage: python tests/netns_trainer.py OUT.json CONTROL_DIR MODEL_DIR TRAINER_ADDR URL1 URL2

Pushes over HTTP, by broadcast and through the relays on the servers' hosts (LORA_SYNC_TEST_RELAYS:
URL=RELAY_URL,...) to two servers on two other hosts, times a rank-64
broadcast to one host and to two, then broadcasts while the controller cuts srv2's link
(files in CONTROL_DIR say when), and forms groups without srv2 and, once its link is back,
with it again. Writes what it saw to OUT.json (with what each server on the fake engine
recorded that a real engine would have crashed on); the test checks it."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from lora_sync import LoRAAdapter, LoRASyncClient, collective
from lora_sync.errors import LoRASyncError
from lora_sync.transports import broadcast
from testbed.tiny_model import make_lora, randomize_lora

API_KEY = os.environ["LORA_SYNC_TEST_KEY"]
# How long past the group's timeout the trainer waits for a cut server's reply: shortened by
# the test (a wait, not the logic; the bound it checks is the same sum).
broadcast.REPLY_GRACE_S = float(os.environ["LORA_SYNC_TEST_REPLY_GRACE_S"])
WAIT_S = 120  # bound on every wait for the controller


def adapter(model_dir, seed: int, rank: int = 8) -> LoRAAdapter:
    model = make_lora(model_dir, rank=rank)
    randomize_lora(model, seed)
    a = LoRAAdapter.from_peft_model(model)
    return LoRAAdapter({k: v.clone() for k, v in a.tensors.items()}, a.config)


def signal_and_wait(control: Path, say: str, expect: str) -> None:
    (control / say).touch()
    deadline = time.monotonic() + WAIT_S
    while not (control / expect).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the controller did not answer {say!r} with {expect!r}")
        time.sleep(0.05)


def greedy(url: str, model: str) -> str:
    with LoRASyncClient(url, api_key=API_KEY, timeout=30) as c:
        return c.complete("the quick brown", model, 12)["text"]


def fake_violations(url: str):
    """What a server on the fake engine (tests/fake_server_main.py) recorded that a real
    engine would have crashed on; None from a server that is not one."""
    import http.client
    from urllib.parse import urlsplit
    u = urlsplit(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        c.request("GET", "/fake/violations")
        r = c.getresponse()
        return json.loads(r.read()) if r.status == 200 else None
    finally:
        c.close()


def main(out, control, model_dir, addr, url1, url2) -> None:
    report = {}
    both = [url1, url2]
    with LoRASyncClient(both, api_key=API_KEY, timeout=60) as client:
        report["tensors"] = [r.version for r in client.push(adapter(model_dir, 1), "mh",
                                                             transport="tensors")]
        report["tensors_out"] = [greedy(u, "mh") for u in both]
        client.init_group(master_address=addr, timeout_s=10)
        report["broadcast"] = [r.version for r in client.push(adapter(model_dir, 2), "mh",
                                                              transport="broadcast")]
        report["broadcast_out"] = [greedy(u, "mh") for u in both]
        client.destroy_group()
    # One copy per node: the trainer sends to srv1's relay, which passes it on to srv2's.
    relays = dict(r.split("=", 1) for r in os.environ["LORA_SYNC_TEST_RELAYS"].split(","))
    with LoRASyncClient(both, api_key=API_KEY, timeout=60, relays=relays) as client:
        report["relay"] = [[r.version, r.transport] for r in client.push(
            adapter(model_dir, 7), "mh-relay", transport="relay")]
        report["relay_out"] = [greedy(u, "mh-relay") for u in both]

    # The link cut, between the metadata POSTs and the tensors (a hook in the trainer's
    # send: the controller cuts srv2, then the broadcast goes on).
    send = collective.send_transfer

    def send_after_cut(*args, **kwargs):
        time.sleep(1.0)  # the metadata POSTs (sent on other threads) reach both servers
        signal_and_wait(control, "posted", "cut")
        return send(*args, **kwargs)
    collective.send_transfer = send_after_cut
    client = LoRASyncClient(both, api_key=API_KEY, timeout=60)
    client.init_group(master_address=addr, timeout_s=4)
    t0 = time.perf_counter()
    try:
        client.push(adapter(model_dir, 4), "mh", transport="broadcast")
        report["cut_error"] = None
    except LoRASyncError as e:
        report["cut_error"] = f"{type(e).__name__}: {e.code}: {e.message[:300]}"
    report["cut_error_s"] = time.perf_counter() - t0
    collective.send_transfer = send
    client.states["broadcast"].group.pg.shutdown()  # the broken group; srv1's side is destroyed below
    client.states["broadcast"].group = None
    client.close()

    with LoRASyncClient([url1], api_key=API_KEY, timeout=30) as one:
        report["srv1_alias_after_cut"] = one.adapters()[0]["adapters"]
        one.init_group(master_address=addr, timeout_s=10, group_name="without-srv2")
        report["without_srv2"] = [r.version for r in one.push(adapter(model_dir, 5), "mh",
                                                               transport="broadcast")]
        one.destroy_group()

    signal_and_wait(control, "restore", "restored")
    with LoRASyncClient(both, api_key=API_KEY, timeout=60) as client:
        client.init_group(master_address=addr, timeout_s=10, group_name="with-srv2")
        report["with_srv2_again"] = [r.version for r in client.push(adapter(model_dir, 6),
                                                                    "mh", transport="broadcast")]
        report["with_srv2_out"] = [greedy(u, "mh") for u in both]
        client.destroy_group()
    report["violations"] = [fake_violations(u) for u in both]
    Path(out).write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6])
