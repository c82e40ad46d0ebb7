"""lora_sync.integrations.skyrl against SkyRL 0.3.0's own FSDP policy worker
(scripts/install_rl_frameworks.sh, beside .venv's vLLM 0.32): its `_save_lora_adapters_and_sync`,
as `broadcast_to_inference_engines` calls it, on a PEFT model (not FSDP-wrapped here) in a
one-rank gloo group, with SkyRL's own `collect_lora_params`.

Stand-ins, each for what this machine lacks: `typing.TypedDict` as typing_extensions' while
SkyRL imports (its pydantic models need Python 3.12's; .venv is 3.11), and an empty
`flash_attn` (a CUDA-only package SkyRL imports two names of at module level, unused here).

Checked: SkyRL's generator name `skyrl-lora` serves the pushed adapter, PEFT's own greedy
tokens on the real vLLM server; each sync is a new version; nothing is written where SkyRL
would have written the adapter; SkyRL's own disk sync is what it replaces."""
from __future__ import annotations

import asyncio
import importlib.machinery
import socket
import sys
import types
import typing

import pytest
import torch.distributed as dist
import typing_extensions

from lora_sync import LoRASyncClient

from .conftest import API_KEY, rl_frameworks
from .helpers import PROMPT
from .peft_oracle import peft_greedy, peft_model, server_greedy



def _no_flash_attn() -> dict:
    """STAND-IN: flash_attn (CUDA only), with the two names SkyRL imports."""
    def unavailable(*args, **kwargs):
        raise NotImplementedError("flash_attn stand-in: CUDA only")
    package = types.ModuleType("flash_attn")
    package.__path__ = []
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.__spec__ = importlib.machinery.ModuleSpec("flash_attn.bert_padding", None)
    padding.pad_input = padding.unpad_input = unavailable
    package.bert_padding = padding
    return {"flash_attn": package, "flash_attn.bert_padding": padding}


@pytest.fixture(scope="module")
def skyrl():
    with rl_frameworks("skyrl-gym"), pytest.MonkeyPatch.context() as mp:
        mp.setattr(typing, "TypedDict", typing_extensions.TypedDict)  # STAND-IN: Python 3.12's
        for name, module in _no_flash_attn().items():
            mp.setitem(sys.modules, name, module)
        from skyrl.backends.skyrl_train.inference_servers import remote_inference_client
        from skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker import FSDPPolicyWorkerBase
        original = FSDPPolicyWorkerBase._save_lora_adapters_and_sync
        yield types.SimpleNamespace(worker=FSDPPolicyWorkerBase,
                                    name=remote_inference_client.SKYRL_LORA_ADAPTER_NAME)
        FSDPPolicyWorkerBase._save_lora_adapters_and_sync = original


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo group: SkyRL's sync asks for its rank and meets at a barrier."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    yield
    dist.destroy_process_group()


@pytest.mark.server
def test_skyrls_sync_pushes_what_its_generator_asks_for(skyrl, one_rank, model_dir, vllm,
                                                        tmp_path):
    from lora_sync.integrations import skyrl as integration
    integration.install([vllm.url], api_key=API_KEY)
    sync_dir = tmp_path / "skyrl_lora_sync"  # where SkyRL would write the adapter
    with LoRASyncClient(vllm.url, api_key=API_KEY) as c:
        for version, seed in ((1, 901), (2, 902)):
            model = peft_model(model_dir, seed, task_type="CAUSAL_LM")
            worker = types.SimpleNamespace(model=types.SimpleNamespace(model=model))
            asyncio.run(skyrl.worker._save_lora_adapters_and_sync(
                worker, model, str(sync_dir), inference_engine_client=None,
                lora_name=skyrl.name))
            assert c.newest_versions(skyrl.name) == [version]
            assert server_greedy(c, skyrl.name, PROMPT, 12) == \
                peft_greedy(model, model_dir, PROMPT, 12)
        assert not sync_dir.exists()  # no disk
        c.retire(skyrl.name)
