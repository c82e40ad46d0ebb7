"""lora-sync core: engine-agnostic wire format, naming, checks and the trainer client.

Imports no inference engine."""
from .adapter import LoRAAdapter, ModelSpec, check_adapter
from .trainer.client import LoRASyncClient
from .trainer.packing import pack_parameters
from .transports.base import PushResult, Server
from .errors import (BadAdapter, BadRequest, LoRASyncError, NotFound, PayloadTooLarge, PushFailed,
                     TransferFailed, Unauthorized, VersionConflict)
from .naming import VersionBook, split_versioned, versioned

__all__ = ["LoRAAdapter", "ModelSpec", "check_adapter", "LoRASyncClient", "pack_parameters",
           "PushResult",
           "Server", "BadAdapter", "BadRequest", "LoRASyncError", "NotFound", "PayloadTooLarge", "PushFailed",
           "TransferFailed", "Unauthorized", "VersionConflict", "VersionBook",
           "split_versioned", "versioned"]
__version__ = "0.1.0"
