"""TEST-ONLY startup patch for SGLang servers started by lora-sync's tests (CPU machines).

SGLang 0.5.23's LoRA layers and LoRA backends (sglang/srt/lora/layers.py,
sglang/srt/lora/backend/*.py) hard-code ``pin_memory=True`` / ``.pin_memory()``. Without an
accelerator, PyTorch raises "pin_memory=True requires a CUDA or other accelerator backend".

Python imports ``sitecustomize`` at startup in every process whose PYTHONPATH holds this
directory -- including SGLang's spawned scheduler/detokenizer processes, which a monkey patch
made only in the launcher would not reach. To stay cheap and narrow, nothing is patched at
startup: an import hook waits for the first import of ``sglang.srt.lora`` and, only if no
accelerator is available, makes pinning a no-op (``pin_memory=True`` is dropped from tensor
factory calls and ``Tensor.pin_memory()`` returns the tensor itself). Pinned memory only
speeds up host->device copies, so on a CPU-only engine this changes no result.
"""
import importlib.abc
import sys

_TRIGGER = "sglang.srt.lora"
_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like",
              "zeros_like", "ones_like", "full_like", "empty_strided")


def _neutralise_pin_memory():
    import functools

    import torch

    if getattr(torch, "_lora_sync_pin_memory_neutralised", False):
        return
    try:
        has_accel = torch.accelerator.is_available()
    except AttributeError:
        has_accel = torch.cuda.is_available()
    if has_accel:
        return

    def drop_pin(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
            return fn(*args, **kwargs)
        return wrapper

    for name in _FACTORIES:
        setattr(torch, name, drop_pin(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    torch._lora_sync_pin_memory_neutralised = True


class _PinMemoryPatchHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == _TRIGGER:
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
            _neutralise_pin_memory()
        return None


if not any(isinstance(f, _PinMemoryPatchHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _PinMemoryPatchHook())


# MoE LoRA (tests/sgl_kernel_standin/moe_lora_cpu_standin.py, TEST-ONLY stand-ins for the
# Triton/CUDA pieces of SGLang's routed-expert LoRA path): installed right after the module
# that needs each one is executed, and only without an accelerator. A dense model never
# calls what they register.
def _after_lora_moe_runners(module):
    import moe_lora_cpu_standin as standin

    import sglang.kernels.ops.lora.moe.fused_moe_lora_kernel as kernel
    if not hasattr(module, "moe_lora_align_block_size"):  # imported on CUDA/HIP/XPU only
        module.moe_lora_align_block_size = standin.moe_lora_align_block_size_standin
    kernel.fused_moe_lora = standin.fused_moe_lora_standin


def _after_moe_runner(module):
    import moe_lora_cpu_standin as standin
    module.register_moe_runner_core("triton", standin.make_torch_moe_runner_core)


_AFTER_IMPORT = {"sglang.srt.lora.lora_moe_runners": _after_lora_moe_runners,
                 "sglang.srt.layers.moe.moe_runner.runner": _after_moe_runner}


def _no_accelerator() -> bool:
    import torch
    try:
        return not torch.accelerator.is_available()
    except AttributeError:
        return not torch.cuda.is_available()


class _AfterImportHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        after = _AFTER_IMPORT.get(fullname)
        if after is None or not _no_accelerator():
            return None
        spec = next((s for f in sys.meta_path if f is not self and hasattr(f, "find_spec")
                     for s in [f.find_spec(fullname, path, target)] if s is not None), None)
        if spec is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            after(module)
        spec.loader.exec_module = exec_module
        return spec


if not any(isinstance(f, _AfterImportHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterImportHook())
