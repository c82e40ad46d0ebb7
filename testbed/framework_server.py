"""A vLLM server built the way RL frameworks build their own (verl's `vLLMHttpServer`), with
lora-sync mounted through its public API (vllm_ext/mount.py), never through our launcher.

    python -m testbed.framework_server --model DIR --port N [vLLM args]

Like verl 0.9.1: the framework parses vLLM's own arguments, passes a worker extension of its
own, builds `AsyncLLM.from_vllm_config` itself, then vLLM's `build_app` / `init_app_state`,
and runs uvicorn on its own event loop. vLLM's endpoint plugins are not named (older vLLM
releases have none), so lora-sync comes in by `mount` and `start` alone.

The framework's own surface, for tests and as a template:
  POST /framework/generate {"prompt_ids", "max_tokens", "adapter"}: generation the way a Ray
      method calls the engine (no HTTP admission: `service.using` resolves the name), replies
      {"token_ids", "served_by"}.
  POST /framework/workers: a method of the framework's worker extension on every worker
      (composed with lora-sync's), replies its results."""
from __future__ import annotations

import asyncio
import sys
import uuid

from fastapi import Request  # module level: the routes' annotations are read by name
from fastapi.responses import JSONResponse

from lora_sync.errors import LoRASyncError
from vllm_ext.mount import mount, start, worker_extension


class FrameworkWorkerExtension:
    """Stands for a framework's own worker extension (verl's vLLMColocateWorkerExtension)."""

    def framework_hello(self) -> str:
        return f"framework extension on a worker holding lora_sync_call: " \
               f"{callable(getattr(self, 'lora_sync_call', None))}"


async def serve(argv: list[str]) -> None:
    import uvicorn
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.sampling_params import SamplingParams
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    args.enable_lora = True
    args.worker_extension_cls = worker_extension(f"{__name__}.FrameworkWorkerExtension")
    context = UsageContext.OPENAI_API_SERVER
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=context)
    engine = AsyncLLM.from_vllm_config(vllm_config=config, usage_context=context)
    tasks = await engine.get_supported_tasks()
    app = build_app(args, tasks, config.model_config)
    mount(app, args)
    await init_app_state(engine, app.state, args, tasks)
    service = await start(engine, app.state, args)

    @app.post("/framework/generate")
    async def generate(request: Request):
        body = await request.json()
        params = SamplingParams(max_tokens=int(body["max_tokens"]), temperature=0.0)
        try:
            async with service.using(body["adapter"]) as version:
                async for out in engine.generate({"prompt_token_ids": body["prompt_ids"]},
                                                 params, uuid.uuid4().hex,
                                                 lora_request=version.handle):
                    final = out
        except LoRASyncError as e:  # an unknown or retired name: lora-sync's own reply
            return JSONResponse(e.to_json(), status_code=e.status)
        return {"token_ids": list(final.outputs[0].token_ids),
                "served_by": version.served_name}

    @app.post("/framework/workers")
    async def workers():
        return {"results": await engine.collective_rpc("framework_hello")}

    server = uvicorn.Server(uvicorn.Config(app, host=args.host or "127.0.0.1", port=args.port,
                                           log_level="warning"))
    try:
        await server.serve()
    finally:
        engine.shutdown()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1:]))
