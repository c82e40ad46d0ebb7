"""SGLang plugin (entry point group `sglang.srt.plugins`, name `lora_sync`).

SGLang calls `load()` in its launcher, scheduler and detokenizer processes. The hooks add our
message handler to every scheduler and our routes + admission middleware to the HTTP server.
"""
from __future__ import annotations

from functools import partial

from . import engine_api


def load() -> None:
    engine_api.register_hooks(_on_scheduler, _on_tokenizer_manager)


def _on_scheduler(scheduler) -> None:
    engine_api.check_version()  # raising here stops the server: loud, at start-up
    from worker_extensions.sglang import SchedulerExtension
    engine_api.add_scheduler_handler(scheduler, SchedulerExtension(scheduler).handle)


def _on_tokenizer_manager(tm) -> None:
    engine_api.check_version()
    from lora_sync.server.admission import AdmissionMiddleware
    from lora_sync.server.routes import build_router
    from lora_sync.server.service import AdapterService, Settings

    from .bridge import SGLangBridge
    service = AdapterService(SGLangBridge(tm), Settings.from_env())
    # SGLang's OpenAI routes pick the adapter from `lora_path`, not from `model`.
    app = engine_api.add_routes_and_middleware(
        build_router(""), partial(AdmissionMiddleware, also_set=("lora_path",)))
    app.state.lora_sync = service
