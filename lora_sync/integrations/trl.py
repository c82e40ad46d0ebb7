"""TRL's AsyncGRPOTrainer (trl==1.16.0), with every weight sync a lora-sync push.

The one-line change from TRL's own example:

    from trl.experimental.async_grpo import AsyncGRPOTrainer     # before
    from lora_sync.integrations.trl import AsyncGRPOTrainer      # after

Same arguments (a `peft_config` is required: lora-sync syncs LoRA adapters), plus optional
`lora_sync_servers` (default: the config's `vllm_server_base_url`), `lora_sync_api_key`
(default: $LORA_SYNC_API_KEY), `lora_sync_transport` ("auto" or "broadcast"),
`lora_sync_name` (default TRL's "trl-policy"), `lora_sync_engine` ("vllm" or "sglang": the
engine at `vllm_server_base_url`, and of servers given as URLs), `lora_sync_dtype` (e.g.
torch.bfloat16: cast before sending), `lora_sync_timeout`, and for servers that go down
`lora_sync_restart_timeout`, `lora_sync_health_interval`, `lora_sync_restore_versions` (see
the class doc). The trainer's client is `trainer.lora_sync_client`, every sync's results are
in `trainer.lora_sync_pushes`.

TRL's rollout worker generates at `vllm_server_base_url` only (one URL, no API key sent): give
lora-sync every server behind it (`lora_sync_servers`), e.g. the replicas behind a router.
On SGLang, TRL's "no top-k" (`top_k=0`) is refused by the server, so it is sent as -1.

What changes against TRL's own adapter sync (`_sync_weight_lora`):
  * each sync pushes the PEFT adapter from memory (`LoRASyncClient.push`): nothing is written
    under `<output_dir>/.vllm_lora/`, the server needs no shared file system and no
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING` / `VLLM_SERVER_DEV_MODE`;
  * no `/pause` and `/resume`: a lora-sync version appears atomically, requests running on
    the previous version finish on it, and old versions leave the server's retention window
    (LORA_SYNC_KEEP_VERSIONS) by themselves, so there is no unload either;
  * the version pushed is TRL's `model_version`, so `<name>-v<N>` is exactly the model TRL's
    rollout worker requests; after a restart (resumed or not) numbering continues above the
    newest version any server holds;
  * data-parallel servers take the adapter on every replica (TRL falls back to merged full
    weights there); on a sharded (FSDP2) trainer every rank calls the push, rank 0 sends;
  * what TRL's own adapter check refuses (DoRA, modules_to_save, biases, several active
    adapters, LoRA on the head or embeddings, fused-MoE parameter LoRA) is refused with an
    error instead of TRL's fallback to merged weights, which lora-sync does not have.

A server that goes down while training (killed, restarted, unreachable): see
`AsyncGRPOTrainer`'s doc: training rides out a restart up to `lora_sync_restart_timeout`
(the restarted server gets the newest version back, under its number), then stops with
`ServerDown` naming the server.

On a CPU-only machine call `lora_sync.integrations.trl_cpu.patch()` before building the
trainer (TRL 1.16 needs CUDA otherwise).

Every TRL name this module touches is in TOUCHED; `scripts/drift_check.py trl==<version>`
looks each up in that release's wheel (read, not imported).
"""
from __future__ import annotations

import collections
import inspect
import logging
import os
import time

import torch
from accelerate.utils import broadcast_object_list
from trl.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig
from trl.experimental.async_grpo.async_grpo_trainer import (
    AsyncGRPOTrainer as _TRLAsyncGRPOTrainer, validate_lora_for_vllm_sync)

from .. import naming
from ..api import API_KEY_ENV
from ..adapter import LoRAAdapter, ModelSpec, check_adapter, check_config
from ..errors import BadAdapter, LoRASyncError, PushFailed
from ..server.pins import require_supported
from ..trainer.client import LoRASyncClient
from .server_watch import ServerDown, ServerWatch

__all__ = ["AsyncGRPOTrainer", "ServerDown", "check_servable"]

logger = logging.getLogger("lora_sync")

# "auto": per server, shm on this host, else tensors over HTTP; "broadcast": one collective
TRANSPORTS = ("auto", "broadcast")

# Every TRL name used here, private or not (scripts/drift_check.py checks each against a TRL
# wheel; the coverage check fails if this module uses a TRL import, private attribute or
# overridden private method that is not listed). "(a, b, *, c)": called with these.
TOUCHED = [
    # the class we subclass, and the arguments we read from its call
    "trl.experimental.async_grpo.async_grpo_trainer:AsyncGRPOTrainer"
    "(model, reward_funcs, args, *, peft_config, weight_transfer)",
    # TRL's own adapter check (what TRL's adapter sync refuses, we refuse)
    "trl.experimental.async_grpo.async_grpo_trainer:validate_lora_for_vllm_sync(model)",
    # the two private methods we override: the sync-mode probe (rank 0, inside __init__,
    # before the rollout worker is built with the adapter name) and the adapter sync
    "trl.experimental.async_grpo.async_grpo_trainer:AsyncGRPOTrainer._init_lora_sync(model)",
    "trl.experimental.async_grpo.async_grpo_trainer:AsyncGRPOTrainer._sync_weight_lora(t0)",
    # the name the rollout worker requests as f"{_lora_name}-v{model_version}"
    "trl.experimental.async_grpo.async_grpo_trainer:AsyncGRPOTrainer._lora_name",
    "trl.experimental.async_grpo.async_grpo_trainer:AsyncGRPOTrainer._adapter_name",
    "trl.experimental.async_grpo.async_grpo_trainer:AsyncGRPOTrainer.model_version",
    "trl.experimental.async_grpo.async_grpo_trainer:AsyncGRPOTrainer.rollout_worker",
    "trl.experimental.async_grpo.async_grpo_trainer:RolloutWorkerProtocol"
    ".update_model_version(model_version)",
    "trl.experimental.async_grpo.async_grpo_config:AsyncGRPOConfig.vllm_server_base_url",
    # wrapped on rank 0's worker: the trainer calls it while it waits for rollouts, and it
    # raises ServerDown there (the dataloader is bound to it when train() builds it)
    "trl.experimental.async_grpo.async_grpo_trainer:RolloutWorkerProtocol"
    ".check_health(stale_after_s)",
    # SGLang refuses TRL's "no top-k" (0); the worker sends args.top_k as is
    "trl.experimental.async_grpo.async_grpo_config:AsyncGRPOConfig.top_k",
]


def check_servable(model, infos: list[dict] | None = None):
    """The active adapter's PEFT config if lora-sync can push it; else a ValueError naming
    why: TRL's own adapter check first (DoRA, modules_to_save, bias, ...), then lora-sync's:
    its config rules alone, or, given the servers' `lora_sync_info` replies, the whole check
    each server runs on a push (check_adapter: its model's layers, max rank and coverage)."""
    try:
        peft_config = validate_lora_for_vllm_sync(model)
    except ValueError as e:
        raise ValueError(f"lora-sync cannot sync this adapter: {e} (TRL's own adapter check; "
                         "lora-sync pushes the adapter alone, TRL's merged-weight fallback "
                         "does not apply)") from None
    try:
        adapter = LoRAAdapter.from_peft_model(model, model.active_adapters[0])
        check_config(adapter.config, adapter.rank)
        for info in infos or ():
            check_adapter(adapter.specs(), adapter.config, ModelSpec.from_info(info))
    except BadAdapter as e:
        raise ValueError(f"lora-sync cannot sync this adapter: {e.message}") from None
    return peft_config


class AsyncGRPOTrainer(_TRLAsyncGRPOTrainer):
    """TRL's AsyncGRPOTrainer whose weight syncs are lora-sync pushes (see the module doc).

    A server that goes down while training (killed, restarting, unreachable): training rides
    out its restart for up to `lora_sync_restart_timeout` s (default: `lora_sync_timeout`),
    then stops with an error. While `train()` runs, a thread on rank 0 (`lora_sync_watch`, a
    ServerWatch) checks every server's health every `lora_sync_health_interval` s:
      * a server that answers again is restored at once: a restarted one gets back the
        versions it held, under their numbers (the trainer keeps host copies of the newest
        `lora_sync_restore_versions`, default the servers' LORA_SYNC_KEEP_VERSIONS window;
        then the client's resync), so every `<name>-v<N>` TRL's rollout worker keeps
        retrying (it retries a request with the version it named when it made it: 30 tries,
        up to 16 s apart) is served, by exactly that version, and training goes on. A sync
        that reaches no server waits for them the same way and pushes again; one that
        reaches some goes on (the others get it when they are back);
      * a server still unreachable after the bound stops training: `train()` raises
        `ServerDown` (a LoRASyncError, code `unreachable`) naming the server, how long it was
        down, its last error and what to do, within a few seconds of the bound (TRL checks
        while it waits for rollouts every 5 s; a sync waiting for the server raises it
        itself). TRL's rollout worker stops with it.
    Keep the bound above the servers' restart time and below TRL's own retry span (about
    7 minutes, after which its rollout worker fails by itself). On a sharded trainer rank 0
    decides; the other ranks wait in the next push's collective (and are ended by the
    launcher with rank 0), and a restarted server gets only the newest version back."""

    def __init__(self, *args, lora_sync_servers=None, lora_sync_api_key: str | None = None,
                 lora_sync_transport: str = "auto", lora_sync_name: str = "trl-policy",
                 lora_sync_engine: str = "vllm", lora_sync_dtype=None,
                 lora_sync_timeout: float = 300.0,
                 lora_sync_restart_timeout: float | None = None,
                 lora_sync_health_interval: float = 2.0,
                 lora_sync_restore_versions: int | None = None, **kwargs):
        import trl
        require_supported("TRL", trl.__version__)
        bound = inspect.signature(_TRLAsyncGRPOTrainer.__init__).bind(None, *args, **kwargs)
        if bound.arguments.get("peft_config") is None:
            raise ValueError("lora-sync syncs LoRA adapters: pass peft_config=LoraConfig(...) "
                             "(full fine-tuning syncs full weights, which lora-sync does not)")
        if bound.arguments.get("weight_transfer") is not None:
            raise ValueError("weight_transfer and lora-sync both sync the weights: pass one")
        if lora_sync_transport not in TRANSPORTS:
            raise ValueError(f"lora_sync_transport must be one of {TRANSPORTS}, "
                             f"not {lora_sync_transport!r}")
        # Set before TRL's __init__, which calls _init_lora_sync (below) on rank 0.
        self.lora_sync_servers = lora_sync_servers
        self.lora_sync_api_key = lora_sync_api_key or os.environ.get(API_KEY_ENV)
        self.lora_sync_transport = lora_sync_transport
        self.lora_sync_name = lora_sync_name
        self.lora_sync_engine = lora_sync_engine
        self.lora_sync_dtype = lora_sync_dtype
        self.lora_sync_timeout = lora_sync_timeout
        self.lora_sync_restart_timeout = lora_sync_timeout if lora_sync_restart_timeout is None \
            else lora_sync_restart_timeout
        if self.lora_sync_restart_timeout < 0 or lora_sync_health_interval <= 0:
            raise ValueError("lora_sync_restart_timeout must be >= 0 and "
                             "lora_sync_health_interval > 0")
        self.lora_sync_health_interval = lora_sync_health_interval
        # Copies of the newest versions pushed (rank 0), given back to a restarted server:
        # TRL's worker retries each request with the version it named when it made it.
        self.lora_sync_restore_versions = lora_sync_restore_versions  # None: servers' window
        self.lora_sync_kept: collections.deque = collections.deque()
        self.lora_sync_watch: ServerWatch | None = None  # rank 0, while train() runs
        self.lora_sync_watching = False                   # every rank, while train() runs
        self.lora_sync_client: LoRASyncClient | None = None
        self.lora_sync_pushes: list = []  # one PushResult list per sync, in order
        if lora_sync_engine == "sglang":
            # TRL's rollout worker sends its top_k as is; TRL disables top-k with 0, which
            # SGLang refuses (400 "top_k must be -1 (disable) or at least 1"): use -1.
            config = bound.arguments.get("args")
            if config is None:  # what TRL would build
                config = bound.arguments["args"] = AsyncGRPOConfig(
                    f"{bound.arguments['model'].split('/')[-1]}-AsyncGRPO")
            if config.top_k == 0:
                config.top_k = -1
        super().__init__(*bound.args[1:], **bound.kwargs)
        if self.rollout_worker is not None:
            # TRL calls this every 5 s while it waits for rollouts (which a dead server stops
            # for minutes, TRL's worker retrying): the watch's ServerDown is raised there.
            trl_check = self.rollout_worker.check_health

            def check_health(stale_after_s):
                if self.lora_sync_watch is not None and self.lora_sync_watching:
                    self.lora_sync_watch.raise_failure()
                return trl_check(stale_after_s)
            self.rollout_worker.check_health = check_health

    def train(self, *args, **kwargs):
        """TRL's train(), with the servers watched while it runs (see the class doc)."""
        watch = None
        if self.accelerator.is_main_process:
            watch = self.lora_sync_watch = ServerWatch(
                self.lora_sync_connect(), self.lora_sync_restart_timeout,
                self.lora_sync_health_interval, restore=self.lora_sync_restore).start()
        self.lora_sync_watching = True
        try:
            return super().train(*args, **kwargs)
        finally:
            self.lora_sync_watching = False
            if watch is not None:
                watch.stop()

    # -- the lora-sync side ---------------------------------------------------------------
    def lora_sync_connect(self) -> LoRASyncClient:
        """The client (made once; on every rank, only rank 0 talks to the servers)."""
        if self.lora_sync_client is None:
            servers = self.lora_sync_servers or [self.args.vllm_server_base_url]
            self.lora_sync_client = LoRASyncClient(
                servers, engine=self.lora_sync_engine, api_key=self.lora_sync_api_key,
                timeout=self.lora_sync_timeout)
            if self.lora_sync_transport == "broadcast" and self.accelerator.is_main_process:
                self.lora_sync_client.init_group(
                    backend="nccl" if torch.cuda.is_available() else "gloo")
        return self.lora_sync_client

    # -- TRL's two hooks --------------------------------------------------------------------
    def _init_lora_sync(self, model) -> bool:
        """Rank 0, inside TRL's __init__: checks the adapter and the servers, names the adapter
        the rollout worker will request; True selects TRL's adapter-sync path."""
        check_servable(model)
        client = self.lora_sync_connect()
        info = client.info()
        if self.lora_sync_restore_versions is None:  # what the servers keep of a name
            self.lora_sync_restore_versions = min(int(i.get("keep_versions") or 1)
                                                  for i in info)
        check_servable(model, info)
        self._lora_name = self.lora_sync_name
        logger.info("TRL AsyncGRPO: LoRA syncs are lora-sync pushes (%s) of %s-v<N> to %s",
                    self.lora_sync_transport, self.lora_sync_name,
                    ", ".join(s.url for s in client.servers))
        return True

    def _sync_weight_lora(self, t0: float) -> tuple[float, float, float]:
        """Every rank: pushes the adapter as version model_version + 1 (no pause, no disk),
        then moves the rollout worker to it. Returns TRL's (pause, barrier, transfer) marks:
        no pause and no barrier of its own (a sharded push is its own collective)."""
        client = self.lora_sync_connect()
        model = self.accelerator.unwrap_model(self.model)
        adapter = LoRAAdapter.from_peft_model(model, self._adapter_name)
        version = self.model_version + 1
        if not self.lora_sync_pushes and self.accelerator.is_main_process:
            # First sync of this trainer: a restarted one continues above what servers hold,
            # so <name>-v<N> never names another trainer's adapter.
            held = [v for v in client.newest_versions(self.lora_sync_name) if v]
            version = max([version, *(v + 1 for v in held)])
        results = self.lora_sync_push(client, adapter, version)
        self.lora_sync_pushes.append(results)
        self.lora_sync_keep(results[0].version, adapter)
        t_transfer = time.time()
        # The version exists on every server now: only then may the worker request it.
        self.model_version = results[0].version
        if self.rollout_worker:
            self.rollout_worker.update_model_version(self.model_version)
        return t0, t0, t_transfer

    def lora_sync_push(self, client: LoRASyncClient, adapter, version: int) -> list:
        """Every rank: the push of `version`. Outside train() a failure raises at once. Inside,
        a server the push could not reach that does not answer its health check either (or
        answers from a new instance) is ridden out: a push that reached no server is made
        again once they are back (rank 0 waits with the watch, up to the bound; the other
        ranks wait for it in the push's collective), one that reached some goes on (the
        watch resyncs the others when they are back)."""
        while True:
            if self.lora_sync_watching and self.lora_sync_watch is not None:
                self.lora_sync_watch.raise_failure()  # training stops once one was down too long
            results = client.push(adapter, self.lora_sync_name, version=version,
                                  transport=self.lora_sync_transport,
                                  dtype=self.lora_sync_dtype, on_error="skip")
            failed = [r for r in results if not r.ok]
            if not failed:
                return results
            down = self.lora_sync_down(client, [r.server for r in failed])
            if down is None:
                raise failed[0].error if len(results) == 1 else PushFailed(results)
            if any(r.ok for r in results):
                return results
            if self.lora_sync_watch is not None:
                self.lora_sync_watch.wait_up(down)

    def lora_sync_down(self, client: LoRASyncClient, urls: list[str]) -> list[str] | None:
        """Every rank, after a push failed on `urls`: those of them still down (to wait for),
        or None when the failure is not one to ride out (outside train(), or a server that
        answers from the same instance: the push's own error). Rank 0 decides."""
        verdict = None
        watch = self.lora_sync_watch
        if self.accelerator.is_main_process and self.lora_sync_watching and watch is not None:
            health = {h["server"]: h for h in client.health(timeout=5.0)}
            down = [u for u in urls if not health[u]["ok"]]
            if all(u in down or health[u]["restarted"] for u in urls):
                for u in down:
                    watch.down(u, health[u]["error"])
                for u in urls:  # back already, before the watch saw it: restored here
                    if u not in down:
                        watch.back(u, health[u])
                verdict = down
        if self.accelerator.num_processes > 1:
            verdict = broadcast_object_list([verdict], from_process=0)[0]
        return verdict

    # -- servers that restart ---------------------------------------------------------------
    def lora_sync_keep(self, version: int, adapter: LoRAAdapter) -> None:
        """Rank 0: a copy (host memory) of the version just pushed, among the newest
        `lora_sync_restore_versions`. A sharded trainer's ranks hold shards: nothing is kept
        there, and a restarted server gets the newest version alone (the client's resync)."""
        keep = self.lora_sync_restore_versions or 0
        if not self.accelerator.is_main_process or keep < 2 or \
                any(hasattr(t, "full_tensor") for t in adapter.tensors.values()):
            return
        self.lora_sync_kept.append((version, LoRAAdapter(
            {k: t.detach().to("cpu", copy=True) for k, t in adapter.tensors.items()},
            dict(adapter.config))))
        while len(self.lora_sync_kept) > keep:
            self.lora_sync_kept.popleft()

    def lora_sync_restore(self, url: str) -> dict:
        """The watch's restore of a server that is back (rank 0): the versions kept, oldest
        first, where it lacks them (so that what TRL's worker still retries is there, as it
        was before the restart), then the client's resync (every name's newest)."""
        client, pushed, errors = self.lora_sync_connect(), [], []
        server = next(s for s in client.servers if s.url == url)
        kept = list(self.lora_sync_kept)
        if kept:
            with LoRASyncClient([server], api_key=self.lora_sync_api_key,
                                timeout=client.timeout, remember=False,
                                lease_ahead=False) as one:
                held = one.newest_versions(self.lora_sync_name)[0] or 0
                for version, adapter in kept:
                    if version <= held:
                        continue
                    try:
                        one.push(adapter, self.lora_sync_name, version=version,
                                 dtype=self.lora_sync_dtype)
                        pushed.append(naming.versioned(self.lora_sync_name, version))
                    except LoRASyncError as e:  # e.g. a newer one is there already
                        errors.append(f"{naming.versioned(self.lora_sync_name, version)}: {e}")
        [resync] = client.resync([url])
        if errors:
            logger.warning("lora-sync: %s: versions not given back: %s", url, "; ".join(errors))
        return {"server": url, "pushed": pushed + resync["pushed"], "error": resync["error"]}
