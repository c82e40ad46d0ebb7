"""lora-sync's HTTP API as both sides name it: its own routes that are not a transport's
(paths without the engine's prefix: `/v1` on vLLM, the root on SGLang; each transport names
its own) and the environment variables of the admin key and of the servers' list. The server mounts these
(server/routes.py); the client and the CLI call them (Server.route)."""
from __future__ import annotations

import os
import re

RETIRE_ROUTE = "/retire_lora_adapter"
ALIAS_ROUTE = "/lora_sync_alias"  # rollback and pinning (service.point_alias)
INFO_ROUTE = "/lora_sync_info"
ADAPTERS_ROUTE = "/lora_adapters"
GET_ROUTES = (INFO_ROUTE, ADAPTERS_ROUTE)

# The operator's key: the server's Settings read it, the CLI and the TRL integration default
# to it.
API_KEY_ENV = "LORA_SYNC_API_KEY"
# The servers a trainer pushes to, when it is not told: URLs separated by commas and/or
# whitespace (the CLI, the SkyRL integration).
SERVERS_ENV = "LORA_SYNC_SERVERS"


def servers_from_env() -> list[str]:
    """SERVERS_ENV's URLs, in order, each once (not checked: the caller says where from)."""
    urls = re.split(r"[\s,]+", os.environ.get(SERVERS_ENV, "").strip())
    return list(dict.fromkeys(u for u in urls if u))
