"""What a push may carry: names, versions, bodies and their limits, the weights' integrity,
engine refusals and concurrent pushes, in process on the FAKE engine
(tests/service_helpers.py says what these suites check)."""
from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_sync import LoRASyncClient, LoRASyncError, NotFound, VersionConflict, http, wire

from .engine_fakes import BASE_TEXT, served_text
from .helpers import (AUTH, PROMPT, Background, bad_bodies, body_of, greedy, post_body,
                      versions_of, wait_until)
from .service_helpers import MAX_BODY, TENSORS, route, listing, error_of, inflight
from .service_helpers import clean_slate  # noqa: F401  (autouse: it applies to this module)


# -- names ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["base", "BASE", "Base", "disk-taken", "DISK-TAKEN"])
def test_a_push_never_shadows_an_engine_name(fake_server, fake_client, make_adapter, workdir,
                                            name):
    """test_integrity.py::test_a_push_never_shadows_the_served_model, and the adapters the
    engine loaded itself (any letter case): 409 name_taken, nothing listed."""
    c = fake_client
    make_adapter(seed=310).save(workdir / "disk-taken")
    c.load_from_disk(str(workdir / "disk-taken"), "disk-taken")
    try:
        before = greedy(c, "base"), greedy(c, "disk-taken")
        for transport in ("tensors", "shm"):
            with pytest.raises(LoRASyncError) as e:
                c.push(make_adapter(seed=311), name, transport=transport)
            assert e.value.code == "name_taken" and e.value.status == 409
        assert (greedy(c, "base"), greedy(c, "disk-taken")) == before
        models = http.call("GET", f"{fake_server.url}/v1/models", headers=AUTH)[0]
        assert not any(m["id"].casefold().startswith(f"{name.casefold()}-v")
                       for m in models["data"])
        assert listing(c, name) is None
    finally:
        c.unload_from_disk("disk-taken")


@pytest.mark.parametrize("name", ["nl\n", "a" * 128 + "\n", "ünï", "a" * 129, "", "a/b",
                                  "-lead", "pol-v2", ".."])
def test_names_are_ascii_and_whole(fake_client, make_adapter, name):
    """A name is 1-128 ASCII letters, digits, '.', '_' or '-', starting with a letter or
    digit, matched whole (no trailing newline), and does not end in -v<N>: anything else is
    a 400 bad_name."""
    status, reply = post_body(route(fake_client, TENSORS), body_of(make_adapter(seed=641),
                                                                    name=name))
    assert (status, error_of(reply)[1]) == (400, "bad_name"), reply


@pytest.mark.parametrize("version", ["1_0", "\u0663", " 7 ", "+4", "9" * 4300, "0",
                                     str(2 ** 63), "-1", "1e3"])
def test_versions_are_ascii_digits_below_2_63(fake_client, make_adapter, version):
    """A version that is not 1-19 ASCII digits between 1 and 2**63 - 1 is a 400 bad_version,
    and no reservation is left behind (the next push of the name works, at v1)."""
    name = "verdigits"
    meta = make_adapter(seed=651).metadata(name)
    meta["version"] = version
    status, reply = post_body(route(fake_client, TENSORS),
                              wire.encode_bytes(make_adapter(seed=651).tensors, meta))
    assert (status, error_of(reply)[1]) == (400, "bad_version"), reply
    assert fake_client.push(make_adapter(seed=652), name, transport="tensors")[0].version == 1


def test_names_are_capped_and_can_be_retired(make_fake_server, make_adapter):
    """On a server of its own with LORA_SYNC_MAX_NAMES=3: one name more is a 429
    too_many_names on every transport, a name already held still takes pushes, and retiring
    a name (404 version_retired from then on) makes room for another."""
    server = make_fake_server(max_names=3)
    adapter = make_adapter(seed=681)
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        assert c.info()[0]["max_names"] == 3
        for i in range(3):
            c.push(adapter, f"cap{i}", transport="tensors")
        for transport in ("tensors", "shm"):
            with pytest.raises(LoRASyncError) as e:
                c.push(adapter, "cap3", transport=transport)
            assert (e.value.status, e.value.code) == (429, "too_many_names")
        # A name the server already holds still takes pushes.
        assert c.push(adapter, "cap0", transport="tensors")[0].version == 2
        assert len(c.adapters()[0]["adapters"]) == 3
        assert c.retire("cap1")[0]["retired"] == [1]
        with pytest.raises(NotFound) as e:
            c.complete(PROMPT, "cap1", 2)
        assert e.value.code == "version_retired"
        assert c.push(adapter, "cap-new", transport="tensors")[0].version == 1
        with pytest.raises(LoRASyncError) as e:
            c.push(adapter, "cap1", transport="tensors")
        assert e.value.code == "too_many_names"


def test_a_retired_name_stops_counting_while_it_drains(make_fake_server, make_adapter):
    """AdapterService.retire_name: 'the name no longer counts against LORA_SYNC_MAX_NAMES',
    also while a request still runs on one of its versions."""
    server = make_fake_server(max_names=2)
    adapter = make_adapter(seed=682)
    with LoRASyncClient(server.url, api_key=server.api_key) as c:
        c.push(adapter, "n1", transport="tensors")
        c.push(adapter, "n2", transport="tensors")
        request = Background("POST", f"{server.url}/v1/completions",
                             {"model": "n1", "prompt": PROMPT, "fake_delay_s": 1.0})
        wait_until(lambda: inflight(c, "n1-v1") == 1, what="the request admitted")
        c.retire("n1")
        try:
            assert c.push(adapter, "n3", transport="tensors")[0].version == 1
        finally:
            assert request.join()["status"] == 200


# -- bodies ---------------------------------------------------------------------------------
BAD_BODY_CODES = {
    "not safetensors": (400, "bad_safetensors"), "empty body": (400, "empty_body"),
    "truncated": (400, "bad_safetensors"), "header claims more bytes": (400, "bad_safetensors"),
    "missing lora_name": (400, "bad_name"), "missing adapter_config": (400, "missing_metadata"),
    "adapter_config not JSON": (400, "bad_config"), "adapter_config without r": (400, "bad_config"),
    "rank above max": (400, "rank_too_large"), "unknown module": (400, "unknown_module"),
    "shape does not fit": (400, "bad_shape"), "missing B half": (400, "missing_tensor"),
    "int tensors": (400, "bad_dtype"), "pickle payload": (400, "bad_safetensors"),
    "float64 tensors": (400, "bad_dtype"), "NaN values": (400, "non_finite"),
    "Inf values": (400, "non_finite"), "extra unknown tensor": (400, "unknown_tensor"),
    "lm_head LoRA of another vocabulary": (400, "bad_shape"), "modules_to_save": (400, "unsupported_module"),
    "regex target_modules": (400, "bad_config"), "unknown target module": (400, "unknown_module"),
    "pickle as JSON route": (415, "bad_content_type"),
    "upstream SGLang pickle payload": (415, "bad_content_type"),
    "ForkingPickler payload": (415, "bad_content_type"),
    "ForkingPickler raw body": (400, "bad_safetensors"),
    "duplicate tensor names": (400, "bad_safetensors"), "bad name": (400, "bad_name"),
    "name with version suffix": (400, "bad_name"),
}


def test_bad_inputs_are_refused_and_previous_version_keeps_serving(fake_server, fake_client,
                                                                   make_adapter):
    """Every malformed body (helpers.bad_bodies) is refused, each case's status and code
    pinned (BAD_BODY_CODES), every error reply in our JSON error shape; the previous version
    keeps serving and no worker keeps anything."""
    c = fake_client
    good = make_adapter(seed=31)
    c.push(good, "bad", transport="tensors")
    before = greedy(c, "bad")
    held = fake_server.bridge.held_ids()
    max_rank = c.info()[0]["max_lora_rank"]
    seen = {}
    for case, body, ctype in bad_bodies(make_adapter(seed=32), max_rank):
        status, reply = post_body(route(c, TENSORS), body, ctype or "application/octet-stream")
        seen[case] = (status, error_of(reply)[1])
        assert reply["error"]["message"] and reply["error"]["status"] == status, case
        assert greedy(c, "bad") == before, case
    assert seen == BAD_BODY_CODES
    assert versions_of(c, "bad") == [1]
    assert fake_server.bridge.held_ids() == held, "a refused body left something on a worker"


@pytest.mark.parametrize("case,config,code", [
    ("alpha NaN", '{"r": 8, "lora_alpha": NaN, "target_modules": "all-linear"}', "bad_config"),
    ("alpha Infinity", '{"r": 8, "lora_alpha": Infinity, "target_modules": "all-linear"}',
     "bad_config"),
    ("alpha 1e38", '{"r": 8, "lora_alpha": 1e38, "target_modules": "all-linear"}', "bad_config"),
    ("alpha string", '{"r": 8, "lora_alpha": "16", "target_modules": "all-linear"}',
     "bad_config"),
    ("r 8.5", '{"r": 8.5, "lora_alpha": 16, "target_modules": "all-linear"}', "bad_config"),
    ("r string", '{"r": "8", "lora_alpha": 16, "target_modules": "all-linear"}', "bad_config"),
    ("r 1e400", '{"r": 1e400, "lora_alpha": 16, "target_modules": "all-linear"}', "bad_config"),
    ("r true", '{"r": true, "lora_alpha": 16, "target_modules": "all-linear"}', "bad_config"),
    ("r 0", '{"r": 0, "lora_alpha": 16, "target_modules": "all-linear"}', "bad_config"),
    ("r 65", '{"r": 65, "lora_alpha": 16, "target_modules": "all-linear"}', "rank_too_large"),
    ("dropout NaN", '{"r": 8, "lora_alpha": 16, "lora_dropout": NaN, '
                    '"target_modules": "all-linear"}', "bad_config"),
    ("bias all", '{"r": 8, "lora_alpha": 16, "bias": "all", "target_modules": "all-linear"}',
     "unsupported_module"),
    # served where the engine reads it (docs/coverage.md), but q_proj's tensors have rank 8
    ("rank_pattern", '{"r": 8, "lora_alpha": 16, "rank_pattern": {"q_proj": 4}, '
                     '"target_modules": "all-linear"}', "bad_shape"),
    ("rank_pattern key matching nothing", '{"r": 8, "lora_alpha": 16, "rank_pattern": '
                                          '{"nope_proj": 8}, "target_modules": "all-linear"}',
     "bad_config"),
    ("use_dora", '{"r": 8, "lora_alpha": 16, "use_dora": true, "target_modules": "all-linear"}',
     "unsupported_module"),
    ("deep config", '{"r": 8, "lora_alpha": 16, "x": ' + "[" * 5000 + "]" * 5000 + "}",
     "bad_config"),
])
def test_config_poisoning_is_refused(fake_client, make_adapter, case, config, code):
    """An adapter_config with non-finite, out-of-range or mistyped values, options we do not
    serve (bias, rank_pattern, DoRA) or deep nesting is refused with its code; the served
    adapters and the base model are untouched."""
    c = fake_client
    c.push(make_adapter(seed=621), "tenant", transport="tensors")
    before = greedy(c, "tenant")
    body = body_of(make_adapter(seed=622), name="poison", config=config)
    status, reply = post_body(route(c, TENSORS), body)
    assert (status, error_of(reply)[1]) == (400, code), (case, reply)
    assert greedy(c, "tenant") == before and greedy(c, "base") == BASE_TEXT
    assert listing(c, "poison") is None


def test_tensors_must_match_r_and_name_each_module_once(fake_client, make_adapter):
    """Tensors of another rank than the config's r are a 400 bad_shape, a module named twice
    (with and without the PEFT prefix) a 400 duplicate_module; the served version stays."""
    c = fake_client
    c.push(make_adapter(seed=631), "shape", transport="tensors")
    before = greedy(c, "shape")
    adapter = make_adapter(seed=632)
    t = adapter.tensors
    cases = [("rank-0 tensors with r=8", {k: (v[:0] if "lora_A" in k else v[:, :0])
                                          for k, v in t.items()}, "bad_shape"),
             ("rank-4 tensors with r=8", {k: (v[:4] if "lora_A" in k else v[:, :4])
                                          for k, v in t.items()}, "bad_shape"),
             ("every module twice", {**t, **{k.replace("base_model.model.", ""): v + 1
                                            for k, v in t.items()}}, "duplicate_module")]
    for case, tensors, code in cases:
        status, reply = post_body(route(c, TENSORS), body_of(adapter, name="shape",
                                                             tensors=tensors))
        assert (status, error_of(reply)[1]) == (400, code), (case, reply)
        assert greedy(c, "shape") == before, case
    assert versions_of(c, "shape") == [1]


def test_body_limits(fake_client):
    """A body above the limit (4 MB here) is a 413 payload_too_large, and a 1 GB
    Content-Length is refused before the body is read."""
    status, reply = post_body(route(fake_client, TENSORS), b"\0" * (MAX_BODY + 2 ** 20))
    assert (status, error_of(reply)[1]) == (413, "payload_too_large")
    assert "limit" in reply["error"]["message"]
    from urllib.parse import urlsplit
    u = urlsplit(route(fake_client, TENSORS))
    with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
        sock.sendall((f"POST {u.path} HTTP/1.1\r\nHost: {u.hostname}\r\n"
                      f"Authorization: {AUTH['Authorization']}\r\n"
                      "Content-Type: application/octet-stream\r\n"
                      f"Content-Length: {2 ** 30}\r\n\r\n").encode() + b"\0" * 65536)
        head = sock.recv(4096).decode(errors="replace")
    assert head.startswith("HTTP/1.1 413"), head[:200]


@pytest.mark.parametrize("ctype", ["application/json", "application/x-python-pickle",
                                   "text/plain", ""])
def test_wrong_content_type_names_safe_format(fake_client, make_adapter, ctype):
    """Any other content type than application/octet-stream is a 415 bad_content_type
    naming safetensors, even for a well-formed safetensors body."""
    status, reply = post_body(route(fake_client, TENSORS), body_of(make_adapter(seed=99)),
                              ctype)
    assert (status, error_of(reply)[1]) == (415, "bad_content_type"), reply
    assert "safetensors" in reply["error"]["message"]


def test_header_bomb_is_refused_cheaply(fake_client):
    """A safetensors header length above the limit, or a header of a million nested lists,
    is refused cheaply (400)."""
    huge = (wire.MAX_HEADER_BYTES + 1).to_bytes(8, "little") + b"{" * 64
    status, reply = post_body(route(fake_client, TENSORS), huge)
    assert status == 400 and "header length" in reply["error"]["message"], reply
    lists = b'{"a":[' + b"[]," * 1_200_000 + b"[]]}"
    lists += b" " * (-len(lists) % 8)
    status, reply = post_body(route(fake_client, TENSORS), len(lists).to_bytes(8, "little") + lists)
    assert status == 400, reply


# -- integrity -----------------------------------------------------------------------------
def test_checksum_is_verified(fake_client, make_adapter):
    """A push's checksum is verified (tensors and shm): the digest of other weights is a 400
    checksum_mismatch and the served versions stay."""
    c = fake_client
    adapter = make_adapter(seed=121)
    assert c.push(adapter, "sum", checksum=True, transport="tensors")[0].version == 1
    assert c.push(adapter, "sum", transport="shm", checksum=True)[0].version == 2
    before = greedy(c, "sum")
    other = make_adapter(seed=122)
    meta = other.metadata("sum")
    meta["checksum"] = adapter.checksum()  # digest of different weights
    status, reply = post_body(route(c, TENSORS), wire.encode_bytes(other.tensors, meta))
    assert (status, error_of(reply)[1]) == (400, "checksum_mismatch"), reply
    assert greedy(c, "sum") == before and versions_of(c, "sum") == [1, 2]


@pytest.mark.parametrize("transport", ["tensors", "shm", "broadcast"])
def test_non_finite_weights_are_refused_on_every_transport(fake_server, fake_client,
                                                          make_adapter, transport):
    """NaN/Inf weights (LORA_SYNC_CHECK_FINITE=1 on the test servers) are refused by the
    workers whatever carried them; the previous version keeps serving, nothing is held."""
    c = fake_client
    name = f"finite-{transport}"
    if transport == "broadcast":
        c.init_group(timeout_s=20)
    c.push(make_adapter(seed=131), name, transport=transport)
    before = greedy(c, name)
    held = fake_server.bridge.held_ids()
    bad = make_adapter(seed=132)
    key = next(k for k in bad.tensors if "lora_B" in k)
    bad.tensors[key][0, 0] = float("nan")
    with pytest.raises(LoRASyncError) as e:
        c.push(bad, name, transport=transport)
    assert (e.value.status, e.value.code) == (400, "non_finite"), e.value
    assert greedy(c, name) == before and versions_of(c, name) == [1]
    wait_until(lambda: fake_server.bridge.held_ids() == held, what="the refused copy freed")


def test_engine_refusals_and_worker_bugs_change_nothing(fake_server, fake_client, make_adapter):
    """The engine's own refusal at build is a 400 engine_refused; a worker bug a 500
    worker_failed. Either way the previous version serves, no version number is used up and
    no worker keeps a copy."""
    c = fake_client
    c.push(make_adapter(seed=141), "refused", transport="tensors")
    before = greedy(c, "refused")
    held = fake_server.bridge.held_ids()
    engine = fake_server.bridge.workers[0].engine

    def bug(adapter_id, stored):
        raise RuntimeError("a bug in the engine")
    for refuse, status, code in ((lambda i, s: "LoRA rank not supported", 400, "engine_refused"),
                                 (bug, 500, "worker_failed")):
        engine.refuse = refuse
        try:
            for transport in ("tensors", "shm"):
                with pytest.raises(LoRASyncError) as e:
                    c.push(make_adapter(seed=142), "refused", transport=transport)
                assert (e.value.status, e.value.code) == (status, code), e.value
        finally:
            engine.refuse = None
        assert greedy(c, "refused") == before and versions_of(c, "refused") == [1]
        assert fake_server.bridge.held_ids() == held
    assert c.push(make_adapter(seed=142), "refused", transport="tensors")[0].version == 2


def test_concurrent_pushes_of_one_name_are_serialised(fake_client, make_adapter):
    """One client's pushes of one name at once are serialised: versions 1 to 6 once each,
    the alias on the newest; of two explicit pushes of one version, one lands and the other
    is a VersionConflict."""
    c = fake_client
    adapters = [make_adapter(seed=130 + i) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda a: c.push(a, "race", transport="tensors")[0], adapters))
    assert sorted(r.version for r in results) == [1, 2, 3, 4, 5, 6]
    newest = max(results, key=lambda r: r.version)
    assert greedy(c, "race") == greedy(c, newest.name)
    assert greedy(c, newest.name) == served_text(adapters[results.index(newest)])

    def explicit(a):
        try:
            return c.push(a, "race", version=10, transport="tensors")[0].version
        except VersionConflict:
            return "conflict"
    with ThreadPoolExecutor(2) as pool:
        outcomes = sorted(map(str, pool.map(explicit, adapters[:2])))
    assert outcomes == ["10", "conflict"]


def test_concurrent_pushes_from_independent_clients(fake_server, make_adapter):
    """Two clients (no shared memory of versions) push one name at once: the one that
    loses the race numbers above the winner once, so both land, and the alias ends on the
    newest."""
    adapters = [make_adapter(seed=150 + i) for i in range(2)]

    def push(a):
        with LoRASyncClient(fake_server.url, api_key=fake_server.api_key) as own:
            return own.push(a, "many", transport="tensors")[0].version
    with ThreadPoolExecutor(2) as pool:
        versions = list(pool.map(push, adapters))
    assert sorted(versions) == [1, 2], versions
    with LoRASyncClient(fake_server.url, api_key=fake_server.api_key) as c:
        newest = max(versions)
        assert greedy(c, "many") == served_text(adapters[versions.index(newest)])


def _mutated(body: bytes, cuts, flips, meta_junk):
    b = bytearray(body)
    for pos, val in flips:
        b[pos % len(b)] = val
    if cuts:
        b = b[: cuts % (len(b) + 1)]
    if meta_junk is not None:
        b = bytearray(wire.encode_bytes({}, meta_junk)) + b[8:]
    return bytes(b)


def test_fuzzed_bodies_never_5xx(fake_server, fake_client, make_adapter):
    """A mutated body (cut short, bytes flipped, junk metadata) is a 4xx in our error shape
    (or, rarely, a valid push), never a 5xx, and the server keeps serving."""
    base = make_adapter(seed=141)
    body = wire.encode_bytes(base.tensors, base.metadata("fuzz"))
    url = route(fake_client, TENSORS)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True)
    @given(cuts=st.one_of(st.none(), st.integers(0, 10 ** 6)),
           flips=st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(0, 255)), max_size=6),
           meta_junk=st.one_of(st.none(), st.dictionaries(st.sampled_from(
               ["lora_name", "adapter_config", "version", "checksum", "x"]),
               st.text(max_size=30), max_size=4)))
    def run(cuts, flips, meta_junk):
        status, reply = post_body(url, _mutated(body, cuts, flips, meta_junk))
        assert status < 500, reply
        if status >= 400:
            assert error_of(reply)[0] == status and reply["error"]["message"], reply
    run()
    assert fake_server.alive()
