"""The `lora-sync` command: push, list, inspect and resync adapters on running servers.

    lora-sync --server http://127.0.0.1:8000 push ./adapter_dir --name policy
    lora-sync --server URL1 --server URL2 ls
    lora-sync --server URL info
    lora-sync --server URL1 --server URL2 resync ./adapter_dir --name policy

Servers also come from LORA_SYNC_SERVERS (comma-separated), the key from LORA_SYNC_API_KEY.
The engine of each server is found by asking it (vLLM serves our routes under /v1).
Exit codes: 0 done; 1 a server refused or failed (the message names it); 2 bad usage or
input (a missing directory, an unreadable adapter)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from . import http, naming
from .client import TRANSPORT_CHOICES, LoRASyncClient
from .errors import LoRASyncError, PushFailed
from .transports.base import Server

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def detect_engine(url: str, headers: dict, timeout: float) -> str:
    """vLLM mounts our routes under /v1, SGLang at the root: whichever answers."""
    for engine in ("vllm", "sglang"):
        status, _, _ = http.request("GET", Server(url, engine).route("lora_sync_info"),
                                    headers=headers, timeout=timeout)
        if status != 404:
            return engine
    raise LoRASyncError(f"{url} serves no lora-sync routes (is it started through the "
                        "lora-sync launcher or plugin?)", code="not_found", status=404)


def make_client(args) -> LoRASyncClient:
    urls = args.server or [u for u in os.environ.get("LORA_SYNC_SERVERS", "").split(",") if u]
    if not urls:
        raise UsageError("no server: pass --server URL (repeatable) or set LORA_SYNC_SERVERS")
    key = args.api_key_value
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    servers = [Server(u, args.engine if args.engine != "auto"
                      else detect_engine(u, headers, args.timeout)) for u in urls]
    return LoRASyncClient(servers, api_key=key, timeout=args.timeout)


class UsageError(Exception):
    pass


def read_adapter(path: str):
    from .adapter import LoRAAdapter
    for needed in ("adapter_config.json", "adapter_model.safetensors"):
        if not os.path.isfile(os.path.join(path, needed)):
            raise UsageError(f"{path} is not a PEFT adapter directory (no {needed})")
    try:
        return LoRAAdapter.from_dir(path)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read the adapter in {path}: {e}") from e


# -- commands ---------------------------------------------------------------------------
def cmd_push(client: LoRASyncClient, args) -> list[str]:
    results = client.push(read_adapter(args.dir), args.name, args.version, args.transport,
                          on_error="skip")
    lines = [f"{r.server}  {r.name}  {r.transport}  {r.bytes} bytes  {r.seconds * 1e3:.0f} ms"
             if r.ok else f"{r.server}  FAILED  {r.error.code}: {r.error.message}"
             for r in results]
    if not all(r.ok for r in results):
        raise PushFailed(results)
    return lines


def cmd_ls(client: LoRASyncClient, args) -> list[str]:
    lines = []
    for server, listing in zip(client.servers, client.adapters()):
        lines.append(f"{server.url}  (instance {listing.get('instance_id', '?')[:12]}, "
                     f"keeps {listing.get('keep_versions')} versions per name)")
        for entry in listing["adapters"]:
            versions = ", ".join(f"{v['served_name']} ({v['inflight']} in flight)"
                                 for v in entry["versions"])
            lines.append(f"  {entry['name']} -> {entry['alias_target']}: {versions or '-'}"
                         + (f"; draining {entry['draining']}" if entry["draining"] else ""))
        if not listing["adapters"]:
            lines.append("  (no adapters)")
    return lines


def cmd_info(client: LoRASyncClient, args) -> list[str]:
    return [json.dumps({"server": s.url, "engine": s.engine, **info}, indent=1)
            for s, info in zip(client.servers, client.info())]


def cmd_resync(client: LoRASyncClient, args) -> list[str]:
    """Stateless: the fleet's newest version of the name, pushed from DIR to every server
    that lacks it (a restarted server, one that missed a push)."""
    adapter = read_adapter(args.dir)
    held = client.newest_versions(args.name)
    newest = max([v for v in held if v] or [0])
    if newest == 0:
        raise UsageError(f"no server holds {args.name!r}: use push")
    lines = []
    for server, have in zip(client.servers, held):
        served = naming.versioned(args.name, newest)
        if have == newest:
            lines.append(f"{server.url}  has {served}")
            continue
        with LoRASyncClient([server], api_key=args.api_key_value,
                            timeout=client.timeout) as one:
            [r] = one.push(adapter, args.name, newest, on_error="skip")
        lines.append(f"{server.url}  pushed {served}" if r.ok else
                     f"{server.url}  FAILED  {r.error.code}: {r.error.message}")
        if not r.ok:
            raise PushFailed([r])
    return lines


COMMANDS = {"push": cmd_push, "ls": cmd_ls, "info": cmd_info, "resync": cmd_resync}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lora-sync", description=__doc__.split("\n\n")[0])
    p.add_argument("--server", action="append", metavar="URL",
                   help="a server's base URL (repeat for several; default LORA_SYNC_SERVERS)")
    p.add_argument("--engine", choices=("auto", "vllm", "sglang"), default="auto")
    p.add_argument("--api-key", help="the servers' LORA_SYNC_API_KEY (default: that variable)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per server call")
    sub = p.add_subparsers(dest="command", required=True)
    helps = {"push": "push a PEFT adapter directory as the name's next version",
             "resync": "push DIR as the name's newest version to the servers that lack it"}
    for name, text in helps.items():
        c = sub.add_parser(name, help=text)
        c.add_argument("dir", help="a PEFT adapter directory")
        c.add_argument("--name", required=True, help="the adapter name (versions are NAME-vN)")
        if name == "push":
            c.add_argument("--version", type=int, help="default: the next after the newest")
            c.add_argument("--transport", default="auto",
                           choices=[t for t in TRANSPORT_CHOICES if t != "broadcast"])
    sub.add_parser("ls", help="versions, alias and requests in flight per name")
    sub.add_parser("info", help="workers, limits and instance id of each server")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    args.api_key_value = args.api_key or os.environ.get("LORA_SYNC_API_KEY")
    try:
        client = make_client(args)
        try:
            lines = COMMANDS[args.command](client, args)
        finally:
            client.close()
    except UsageError as e:
        print(f"lora-sync: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except LoRASyncError as e:
        print(f"lora-sync: error: {e.code}: {e.message}", file=sys.stderr)
        return EXIT_FAILED
    print("\n".join(lines))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
