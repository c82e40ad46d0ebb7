"""The transports, one module each, found through this one table.

Each module owns its typed messages, its trainer-side send and its server-side checks:
  tensors    the safetensors body over HTTP (any host)
  shm        the same bytes written straight into server memory (same host)
  broadcast  a torch.distributed broadcast to every worker (NCCL on GPU, gloo on CPU)
"""
from . import broadcast, shm, tensors

TRANSPORTS = {"tensors": tensors, "shm": shm, "broadcast": broadcast}
# Transports that push to one server at a time: push_one(client, server, adapter, name,
# version, checksum) -> PushResult, or None when that server cannot be reached this way.
PER_SERVER = {"tensors": tensors.push_one, "shm": shm.push_one}
