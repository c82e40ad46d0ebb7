"""TEST STAND-IN for SGLang's native ``sgl_kernel`` CPU ops -- NOT the real sgl-kernel.

PyPI's sgl-kernel/sglang-kernel wheels are CUDA-only, but SGLang's CPU engine
(``SGLANG_USE_CPU_ENGINE=1 --device cpu``) imports a handful of its CPU ops even for a tiny
dense Llama model. This package implements exactly those ops in slow, plain PyTorch so that
lora-sync's integration tests can run a real SGLang server on a CPU-only machine.

It is put on PYTHONPATH only for test servers (see tests/sglang_server.py). Never install it
or use it for serving. Any op it does not implement raises NotImplementedError naming the op.

On SGLang 0.5.23 (dense Llama, no speculative decoding) no op is actually called: SGLang only
imports names from here at import time. `assign_req_to_token_pool_cpu` (used by speculative
decoding's `alloc_for_spec_decode`) is implemented with the semantics of SGLang's Triton
kernel `mem_cache/allocation.py:assign_req_to_token_pool`.

Nothing is registered under `torch.ops.sgl_kernel`, on purpose: SGLang enables its Intel AMX
paths only when `hasattr(torch.ops.sgl_kernel, "convert_weight_packed")`, so they stay off even
on AMX hardware, and any `torch.ops.sgl_kernel.<op>` call fails with AttributeError.
"""
from __future__ import annotations

import os
import sys

import torch

__version__ = "0.0.0+lora-sync-test-standin"
IS_TEST_STANDIN = True

_IMPLEMENTED = ("assign_req_to_token_pool_cpu",)
# Names SGLang imported from this module that are not implemented (placeholders).
PLACEHOLDERS: list = []
# LORA_SYNC_STANDIN_TRACE=1 prints every placeholder handed out and every implemented op call.
_TRACE = os.environ.get("LORA_SYNC_STANDIN_TRACE") == "1"
_TRACED_CALLS: set = set()


def _trace(msg: str) -> None:
    print(f"[sgl_kernel TEST STAND-IN pid={os.getpid()}] {msg}", file=sys.stderr, flush=True)


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For each request i, writes its newly allocated KV slots into its row of the
    request->token table: req_to_token[req_pool_indices[i], start[i]:end[i]] = the next
    (end[i] - start[i]) entries of out_cache_loc (requests laid out back to back)."""
    del pool_len  # == req_to_token.shape[1]; only needed by the native kernel
    if _TRACE and "assign_req_to_token_pool_cpu" not in _TRACED_CALLS:
        _TRACED_CALLS.add("assign_req_to_token_pool_cpu")
        _trace("first call of assign_req_to_token_pool_cpu")
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for row, s, e in zip(rows, starts, ends):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += n


def _unimplemented(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but lora-sync's TEST STAND-IN for sgl-kernel "
            f"(tests/sgl_kernel_standin) does not implement it. Implemented: "
            f"{', '.join(_IMPLEMENTED)}.")
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"Unimplemented placeholder for sgl_kernel.{name}: raises NotImplementedError."
    return op


def __getattr__(name: str):
    # SGLang's CPU code does `from sgl_kernel import <op>` at import time for many ops it only
    # calls on other paths (AMX, MoE, quantization...). Importing such a name succeeds and
    # gives a placeholder; *calling* it raises NotImplementedError naming the op.
    if name.startswith("_"):
        raise AttributeError(name)
    op = _unimplemented(name)
    globals()[name] = op
    PLACEHOLDERS.append(name)
    if _TRACE:
        _trace(f"placeholder handed out for sgl_kernel.{name}")
    return op
