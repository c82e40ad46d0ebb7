"""lora-sync's HTTP API as both sides name it: its own routes that are not a transport's
(paths without the engine's prefix: `/v1` on vLLM, the root on SGLang; each transport names
its own) and the environment variable of the admin key. The server mounts these
(server/routes.py); the client and the CLI call them (Server.route)."""
from __future__ import annotations

RETIRE_ROUTE = "/retire_lora_adapter"
ALIAS_ROUTE = "/lora_sync_alias"  # rollback and pinning (service.point_alias)
INFO_ROUTE = "/lora_sync_info"
ADAPTERS_ROUTE = "/lora_adapters"
GET_ROUTES = (INFO_ROUTE, ADAPTERS_ROUTE)

# The operator's key: the server's Settings read it, the CLI and the TRL integration default
# to it.
API_KEY_ENV = "LORA_SYNC_API_KEY"
