"""The model-based fuzz test: random operation sequences against a model of what the server
should list and serve, in process on the FAKE engine
(tests/service_helpers.py says what these suites check)."""
from __future__ import annotations

import itertools
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from lora_sync import LoRASyncClient, NotFound, VersionConflict

from .engine_fakes import served_text
from .helpers import versions_of, wait_until
from .service_helpers import KEEP, wait_drained, complete_raw, error_of, open_leases
from .service_helpers import clean_slate  # noqa: F401  (autouse: it applies to this module)


FUZZ_STEPS = int(os.environ.get("LORA_SYNC_FAKE_FUZZ_STEPS", "40"))


FUZZ_EXAMPLES = int(os.environ.get("LORA_SYNC_FAKE_FUZZ_EXAMPLES", "20"))


SEEDS = (401, 402, 403)


WHICH = st.sampled_from([0, 1])  # which of the run's two names


def test_random_operation_sequences_keep_the_invariants(make_fake_server, make_adapter):
    """test_integrity.py::test_random_operation_sequences_keep_the_invariants, longer: random
    pushes (every transport, auto and explicit versions), retires and requests (alias,
    versions in and out of the window, retired names). After every step: the server lists
    exactly the versions the model says, each request is served by the version it names with
    that version's weights (or is a 404, version_retired for our names), and the fake engine
    saw nothing a real one would crash on. At the end the workers hold no version nobody
    lists. Each run has names of its own (runs do not see each other's retired names). A
    server of its own: the session's shared one may hold other tests' names up to its cap."""
    fake_server = make_fake_server()
    client = LoRASyncClient(fake_server.url, api_key=fake_server.api_key)
    adapters = {s: make_adapter(seed=s) for s in SEEDS}
    expected = {s: served_text(adapters[s]) for s in SEEDS}
    bridge = fake_server.bridge
    runs = itertools.count()
    used: list[str] = []

    class Fuzz(RuleBasedStateMachine):
        @initialize()
        def start(self):
            run = next(runs)
            self.names = (f"fz{run}-a", f"fz{run}-b")
            used.extend(self.names)
            self.served = {}   # name -> {version: seed}, as the model says
            self.gone = {}     # name -> versions that left the window or were retired
            self.retired = set()  # names the server remembers as retired

        def _took(self, name, version, seed):
            versions = self.served.setdefault(name, {})
            versions[version] = seed
            self.gone.setdefault(name, set()).discard(version)
            for old in sorted(versions)[:-KEEP]:
                del versions[old]
                self.gone[name].add(old)
            self.retired.discard(name)

        @rule(which=WHICH, seed=st.sampled_from(SEEDS),
              transport=st.sampled_from(["tensors", "shm", "auto", "broadcast"]))
        def push(self, which, seed, transport):
            name = self.names[which]
            if transport == "broadcast" and client.states["broadcast"].group is None:
                client.init_group(timeout_s=20)
            [res] = client.push(adapters[seed], name, transport=transport)
            assert res.version == max(self.served.get(name, {}), default=0) + 1, res
            self._took(name, res.version, seed)
            self._bounded_after_push()

        @rule(which=WHICH, seed=st.sampled_from(SEEDS), step=st.sampled_from([-1, 0, 1, 2, 5]),
              transport=st.sampled_from(["tensors", "shm"]))
        def push_explicit(self, which, seed, step, transport):
            name = self.names[which]
            newest = max(self.served.get(name, {}), default=0)
            version = newest + step
            if version < 1:
                return
            try:
                [res] = client.push(adapters[seed], name, version=version, transport=transport)
            except VersionConflict:
                assert step <= 0, (name, version, newest)
                return
            assert step > 0 and res.version == version, (name, version, newest)
            self._took(name, version, seed)
            self._bounded_after_push()

        @staticmethod
        def _bounded_after_push():
            """What a push finds waiting for requests to pause is freed before it goes on:
            past it, the workers hold at most one version nobody serves (the one it retired)."""
            served = {v["adapter_id"] for a in client.adapters()[0]["adapters"]
                      for v in a["versions"] if not v["retired"]}
            for held in bridge.held_ids():
                assert len(held - served) <= 1, (sorted(held), sorted(served))

        @rule(which=WHICH)
        def retire(self, which):
            name = self.names[which]
            try:
                out = client.retire(name)[0]
            except NotFound as e:
                assert e.code == "not_found" and not self.served.get(name), e
                return
            assert out["retired"] == sorted(self.served.get(name, {})), out
            self.gone.setdefault(name, set()).update(self.served.pop(name, {}))
            self.retired.add(name)
            wait_drained(client, name)  # then numbering starts again at v1

        @rule(which=WHICH)
        def generate_alias(self, which):
            self._request(self.names[which], None)

        @rule(which=WHICH, pick=st.integers(0, 5))
        def generate_version(self, which, pick):
            name = self.names[which]
            versions, gone = sorted(self.served.get(name, {})), sorted(self.gone.get(name, ()))
            choices = (gone if pick % 2 and gone else versions or gone) or [pick + 1]
            self._request(name, choices[pick % len(choices)])

        def _request(self, name, version):
            """The alias (version None) or a versioned name, served exactly as the model
            says: that version's weights, or a 404 (version_retired for our names)."""
            versions = self.served.get(name, {})
            model = name if version is None else f"{name}-v{version}"
            status, reply, headers = complete_raw(fake_server, model)
            if version is None and not versions:
                assert status == 404, (model, status, reply)  # never another model
                if name in self.retired:
                    assert error_of(reply)[1] == "version_retired", reply
                return
            if version is not None and version not in versions:
                assert status == 404, (model, status, reply)
                if version in self.gone.get(name, ()) or name in self.retired:
                    assert error_of(reply)[1] == "version_retired", (model, reply)
                return
            assert status == 200, (model, status, reply)
            want = max(versions) if version is None else version
            assert int(headers["x-lora-version"]) == want, (model, headers)
            assert reply["model"] == f"{name}-v{want}", (model, reply)
            assert reply["choices"][0]["text"] == expected[versions[want]], (model, reply)

        def teardown(self):
            """Whatever the sequence, no lease is left that the client does not hold ready:
            the late grant of one a push overtook is cancelled once it comes."""
            wait_until(lambda: client.states["shm"].ready.count() == open_leases(client),
                       timeout_s=10, what="the server's open leases are the client's ready ones")

        @invariant()
        def listing_matches_the_model(self):
            for name in getattr(self, "names", ()):
                assert versions_of(client, name) == sorted(self.served.get(name, {})), name
            assert not bridge.violations, bridge.violations

    Fuzz.TestCase.settings = settings(
        max_examples=FUZZ_EXAMPLES, stateful_step_count=FUZZ_STEPS, deadline=None,
        suppress_health_check=list(HealthCheck), derandomize=True)
    try:
        Fuzz.TestCase().runTest()
        for name in used:
            try:
                client.retire(name)
            except NotFound:
                pass
            wait_drained(client, name)
        # Unlisted first, freed right after: the workers then hold nothing.
        wait_until(lambda: bridge.held_ids() == [set()], timeout_s=5,
                   what="the workers free every retired version")
    finally:
        if client.states["broadcast"].group is not None:
            client.destroy_group()
        client.close()
