"""The transports, one module each (base.py: the plug-in they implement). This table is the
only list of them: the server's routes and metrics, the client and the CLI all read it.

  tensors    the safetensors body over HTTP (any host)
  shm        the same bytes written straight into server memory (same host)
  broadcast  a torch.distributed broadcast to every worker (NCCL on GPU, gloo on CPU)
  shared     one sealed memfd of the trainer's, mapped by every server on its host
"""
from .base import Transport
from .broadcast import BroadcastTransport
from .shared_copy import SharedCopyTransport
from .shm import ShmTransport
from .tensors import TensorsTransport

TRANSPORTS: dict[str, Transport] = {
    t.name: t for t in (TensorsTransport(), ShmTransport(), BroadcastTransport(),
                        SharedCopyTransport())}
