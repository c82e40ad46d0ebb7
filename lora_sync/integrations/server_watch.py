"""A trainer's watch over its servers while it trains: servers that come back (restarted)
are resynced at once, one down past a bound is a ServerDown (used by lora_sync.integrations.trl;
needs no training framework)."""
from __future__ import annotations

import logging
import threading
import time

from ..errors import LoRASyncError
from ..trainer.client import LoRASyncClient

logger = logging.getLogger("lora_sync")

__all__ = ["ServerDown", "ServerWatch"]


class ServerDown(LoRASyncError):
    """A server stayed unreachable past the trainer's `lora_sync_restart_timeout`: training
    stopped. `.server`: its URL; `.down_s`: how long it had been down."""
    status, code = 503, "unreachable"

    def __init__(self, server: str, down_s: float, bound: float, last_error: str | None):
        super().__init__(
            f"lora-sync: server {server} has been unreachable for {down_s:.1f} s, longer than "
            f"lora_sync_restart_timeout={bound:g} s (last error: {last_error}); training "
            "stopped, since TRL's rollouts and the next push need it. Restart the server (it "
            "gets the newest adapter version back) and resume from the last checkpoint, or "
            "raise lora_sync_restart_timeout if its restarts take longer, or leave it out of "
            "lora_sync_servers.")
        self.server, self.down_s = server, down_s


class ServerWatch:
    """Rank 0's watch over the trainer's servers while `train()` runs (a daemon thread).

    Every `interval` s it asks each server's health (`LoRASyncClient.health`). A server that
    answers again after failing, or answers from a new instance (a restart: it lost its
    adapters), is resynced at once (`LoRASyncClient.resync`: the newest version of each name
    back, under its number). A server unreachable for more than `bound` s (counted from its
    first failed check or push) is `failure`, a ServerDown, and the watch ends; the trainer
    raises it where it waits (`raise_failure`, `wait_up`). `events`: one dict per server that
    came back ({'server', 'instance_id', 'restarted', 'down_s', 'resynced'})."""

    def __init__(self, client: LoRASyncClient, bound: float, interval: float = 2.0,
                 restore=None):
        self.client, self.bound, self.interval = client, bound, interval
        # restore(url) -> {'server', 'pushed', 'error'}: what a server that is back gets
        # (default: the client's resync, each name's newest version)
        self.restore = restore or (lambda url: self.client.resync([url])[0])
        self.down_since: dict[str, float] = {}   # server url -> first failure (monotonic)
        self.last_error: dict[str, str] = {}
        self.failure: ServerDown | None = None
        self.events: list[dict] = []
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lora-sync-server-watch",
                                        daemon=True)

    def start(self) -> "ServerWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 10.0)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def _run(self) -> None:
        while self.failure is None and not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # never let the watch die quietly: the next check tries again
                logger.exception("lora-sync: the server watch's check failed")

    def check(self) -> None:
        """One round: every server's health; resync those back; ServerDown past the bound."""
        probe = max(5.0, self.interval * 2)  # a busy server is slow, not down
        for h in self.client.health(timeout=probe):
            url = h["server"]
            if not h["ok"]:
                self.down(url, h["error"])
            elif h["restarted"] or url in self.down_since:
                self.back(url, h)

    def back(self, url: str, health: dict) -> None:
        """`url` answers again (`health`: its entry of LoRASyncClient.health): restored, and
        no longer down (or down still, if its restore failed)."""
        resync = self.restore(url)
        if resync["error"]:
            self.down(url, f"answers again, but its resync failed: {resync['error']}")
            return
        with self._changed:
            since = self.down_since.pop(url, None)
            self.last_error.pop(url, None)
            self.events.append({"server": url, "instance_id": health["instance_id"],
                                "restarted": health["restarted"],
                                "down_s": 0.0 if since is None else time.monotonic() - since,
                                "resynced": resync["pushed"]})
            self._changed.notify_all()
        logger.warning("lora-sync: %s is back%s; resynced %s", url,
                       " (restarted)" if health["restarted"] else "",
                       ", ".join(resync["pushed"]) or "nothing (it lost nothing)")

    def down(self, url: str, error: str | None) -> None:
        """Records a failure of `url` (a failed check, or a push that could not reach it)."""
        now = time.monotonic()
        with self._changed:
            first = url not in self.down_since
            since = self.down_since.setdefault(url, now)
            self.last_error[url] = error
            if now - since > self.bound and self.failure is None:
                self.failure = ServerDown(url, now - since, self.bound, error)
            self._changed.notify_all()
        if first:
            logger.warning("lora-sync: %s cannot be reached (%s); waiting up to %g s for it to "
                           "come back", url, error, self.bound)
        if self.failure is not None:
            logger.error("%s", self.failure)

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def wait_up(self, urls) -> None:
        """Returns once every server in `urls` answers again (and is resynced); raises
        ServerDown once one has been down past the bound."""
        urls = set(urls)
        with self._changed:
            while True:
                self.raise_failure()
                if not urls & self.down_since.keys():
                    return
                if not self.running:
                    raise LoRASyncError(f"{', '.join(sorted(urls))}: cannot be reached, and the "
                                        "server watch has stopped", code="unreachable",
                                        status=503)
                self._changed.wait(timeout=1.0)
