"""LoRASyncCallback: a transformers.Trainer pushes its PEFT adapter to live vLLM / SGLang
servers every N optimizer steps.

    from lora_sync.integrations.transformers import LoRASyncCallback

    trainer = Trainer(model=peft_model, args=args, train_dataset=ds,
                      callbacks=[LoRASyncCallback("http://127.0.0.1:8000", "policy",
                                                  every_n_steps=10)])

Each push is `<name>-v<N>` (the alias `<name>` moves to it); `callback.pushes` lists them.
Sharded trainers (FSDP2) run callbacks on every rank, and every rank pushes: the shards are
gathered to rank 0, which alone talks to the servers (LoRASyncClient.push)."""
from __future__ import annotations

from transformers import TrainerCallback

from ..adapter import LoRAAdapter
from ..trainer.client import LoRASyncClient


def unwrap(model):
    """The PEFT model inside DDP / DeepSpeed style wrappers (FSDP2 shards in place)."""
    while not hasattr(model, "peft_config") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "peft_config"):
        raise TypeError(f"LoRASyncCallback pushes PEFT LoRA adapters; the trainer's model is "
                        f"a {type(model).__name__} without one (use peft.get_peft_model)")
    return model


class LoRASyncCallback(TrainerCallback):
    """`servers`: URL(s), `Server`(s), or a `LoRASyncClient` (e.g. one you called init_group
    on). `name`: the adapter name; each push is `<name>-v<N>`. `every_n_steps`: push after
    every N-th optimizer step (TrainerState.global_step). `transport`, `dtype`, `on_error`:
    as in `LoRASyncClient.push` ("broadcast" with URLs: the callback joins the group itself
    on rank 0). `step_versions`: version = global step (`<name>-v<step>`) instead of the
    client's count. `push_on_train_begin` / `push_on_train_end`: also push the adapter before
    the first step / after the last one (if that step was not pushed already).

    `pushes`: one dict per push: step, version, served (the versioned name), results."""

    def __init__(self, servers, name: str, every_n_steps: int = 1, *, api_key: str | None = None,
                 engine: str = "vllm", transport: str = "auto", dtype=None,
                 on_error: str = "raise", step_versions: bool = False,
                 push_on_train_begin: bool = False, push_on_train_end: bool = True,
                 adapter_name: str | None = None, timeout: float = 300.0):
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be a positive integer, not {every_n_steps!r}")
        if step_versions and push_on_train_begin:
            raise ValueError("step_versions numbers pushes by step, and versions start at 1: "
                             "the push before step 1 has no number")
        self.client = servers if isinstance(servers, LoRASyncClient) else \
            LoRASyncClient(servers, engine=engine, api_key=api_key, timeout=timeout)
        self._join_group = transport == "broadcast" and not isinstance(servers, LoRASyncClient)
        self.name, self.every_n_steps, self.transport = name, every_n_steps, transport
        self.dtype, self.on_error, self.step_versions = dtype, on_error, step_versions
        self.push_on_train_begin, self.push_on_train_end = push_on_train_begin, push_on_train_end
        self.adapter_name = adapter_name
        self.pushes: list[dict] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self._join_group and state.is_world_process_zero:
            self.client.init_group()
        self._join_group = False
        if self.push_on_train_begin:
            self.push(model, state.global_step)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every_n_steps == 0:
            self.push(model, state.global_step)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.push_on_train_end and (not self.pushes
                                       or self.pushes[-1]["step"] != state.global_step):
            self.push(model, state.global_step)

    def push(self, model, step: int) -> list:
        """Pushes the model's adapter now (on every rank of a sharded trainer)."""
        model = unwrap(model)
        active = model.active_adapters  # a property on PeftModel, a method on transformers'
        adapter_name = self.adapter_name or (active() if callable(active) else active)[0]
        adapter = LoRAAdapter.from_peft_model(model, adapter_name)
        results = self.client.push(adapter, self.name,
                                   version=step if self.step_versions else None,
                                   transport=self.transport, on_error=self.on_error,
                                   dtype=self.dtype)
        ok = [r for r in results if r.ok]
        self.pushes.append({"step": step, "version": ok[0].version if ok else None,
                            "served": ok[0].name if ok else None, "results": results})
        return results
