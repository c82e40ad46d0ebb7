"""The `lora-sync` command: push, list, inspect and resync adapters on running servers.

    lora-sync --server http://127.0.0.1:8000 push ./adapter_dir --name policy
    lora-sync --server URL1 --server URL2 ls
    lora-sync --server URL info
    lora-sync --server URL1 --server URL2 resync ./adapter_dir --name policy
    lora-sync --server URL rollback policy 3 [--pin]     (VERSION 'newest': follow pushes again)

Servers also come from LORA_SYNC_SERVERS (URLs separated by commas and/or whitespace), the
key from LORA_SYNC_API_KEY. The engine of each server is found by asking it (vLLM serves our
routes under /v1). Each server's failure is its own: a dead server does not stop the others.
Exit codes: 0 done; 1 a server refused or failed (one line per failed server names it);
2 bad usage or input (a malformed URL, a missing directory, an unreadable adapter)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from .. import http, naming
from ..api import ALIAS_ROUTE, API_KEY_ENV, INFO_ROUTE, SERVERS_ENV, servers_from_env
from ..transports import TRANSPORTS
from .client import LoRASyncClient
from ..engines import ENGINES
from ..errors import LoRASyncError
from ..transports.base import Server

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def detect_engine(url: str, headers: dict, timeout: float) -> str:
    """Each engine mounts our routes in its own place: the one where they answer."""
    for engine in ENGINES:
        status, _, _ = http.request("GET", Server(url, engine).route(INFO_ROUTE),
                                    headers=headers, timeout=timeout)
        if status != 404:
            return engine
    err = LoRASyncError(f"{url} serves no lora-sync routes (is it started through the "
                        "lora-sync launcher or plugin?)", code="not_found", status=404)
    err.server = url
    raise err


def server_urls(args) -> list[str]:
    urls = [u for u in args.server if u] if args.server else servers_from_env()
    if not urls:
        raise UsageError("no server: pass --server URL (repeatable) or set LORA_SYNC_SERVERS "
                         "(URLs separated by commas and/or spaces)")
    for url in urls:
        try:
            http.check_url(url)
        except ValueError as e:
            raise UsageError(f"{e} (from {'--server' if args.server else SERVERS_ENV})")
    return list(dict.fromkeys(urls))


def find_servers(args, failed: dict) -> list[Server]:
    """Each URL's engine (asked of the server unless --engine names it); a server that does
    not answer goes into `failed` (url -> its LoRASyncError), the others are returned."""
    urls = server_urls(args)
    if args.engine != "auto":
        return [Server(u, args.engine) for u in urls]
    key = args.api_key_value
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + min(args.timeout, 10.0)  # the command gets its own

    def detect(url: str):
        try:
            with http.within(deadline):
                return Server(url, detect_engine(url, headers, args.timeout))
        except LoRASyncError as e:
            return e
    with ThreadPoolExecutor(len(urls)) as pool:
        found = list(pool.map(detect, urls))
    failed.update((u, f) for u, f in zip(urls, found) if isinstance(f, LoRASyncError))
    return [f for f in found if isinstance(f, Server)]


class UsageError(Exception):
    pass


def check_rollback_args(args) -> None:
    try:
        naming.check_name(args.name)
        args.version_number = None if args.version == "newest" \
            else naming.parse_version(args.version)
    except LoRASyncError as e:
        raise UsageError(e.message) from None
    if args.pin and args.version == "newest":
        raise UsageError("--pin needs a version number")


def read_adapter(path: str):
    from safetensors import SafetensorError

    from ..adapter import LoRAAdapter
    for needed in ("adapter_config.json", "adapter_model.safetensors"):
        if not os.path.isfile(os.path.join(path, needed)):
            raise UsageError(f"{path} is not a PEFT adapter directory (no {needed})")
    try:
        return LoRAAdapter.from_dir(path)
    except (OSError, ValueError, TypeError, KeyError, RecursionError, SafetensorError,
            LoRASyncError) as e:
        raise UsageError(f"cannot read the adapter in {path}: {type(e).__name__}: "
                         f"{str(e)[:500]}") from e


def failure_line(url: str, e: LoRASyncError) -> str:
    return f"{url}  FAILED  {e.code}: {e.message}"


def per_server(client: LoRASyncClient, fn, failed: dict, lines: list | None = None):
    """(server, fn(server)) for each server that answered within the timeout, in order;
    each other one goes into `failed` (and its FAILED line into `lines`, if given)."""
    def guarded(server: Server):
        try:
            return fn(server)
        except LoRASyncError as e:
            return e
    for server, got in zip(client.servers, client._each(guarded, client._deadline(),
                                                        late=lambda server, e: e)):
        if not isinstance(got, LoRASyncError):
            yield server, got
            continue
        failed[server.url] = got
        if lines is not None:
            lines.append(failure_line(server.url, got))


# -- commands: each returns its output lines and puts failed servers in `failed` ---------
def cmd_push(client: LoRASyncClient, args, failed: dict) -> list[str]:
    results = client.push(args.adapter, args.name, args.version, args.transport,
                          on_error="skip")
    failed.update((r.server, r.error) for r in results if not r.ok)
    return [f"{r.server}  {r.name}  {r.transport}  {r.bytes} bytes  {r.seconds * 1e3:.0f} ms"
            if r.ok else failure_line(r.server, r.error) for r in results]


def cmd_ls(client: LoRASyncClient, args, failed: dict) -> list[str]:
    lines = []
    for server, listing in per_server(client, lambda s: client._listing(s, client.timeout),
                                      failed, lines):
        lines.append(f"{server.url}  (instance {(listing.instance_id or '?')[:12]}, "
                     f"keeps {listing.keep_versions} versions per name)")
        pinned = {a.get("name") for a in listing.raw.get("adapters", [])
                  if isinstance(a, dict) and a.get("pinned") is True}
        for entry in listing.adapters:
            versions = ", ".join(f"{v.served_name} ({v.inflight} in flight)"
                                 for v in entry.versions)
            pin = " (pinned)" if entry.name in pinned else ""
            lines.append(f"  {entry.name} -> {entry.alias_target}{pin}: {versions or '-'}"
                         + (f"; draining {list(entry.draining)}" if entry.draining else ""))
        if not listing.adapters:
            lines.append("  (no adapters)")
    return lines


def cmd_info(client: LoRASyncClient, args, failed: dict) -> list[str]:
    lines = []
    for server, info in per_server(client, client._info, failed, lines):
        lines.append(json.dumps({"server": server.url, "engine": server.engine, **info.raw},
                                indent=1))
    return lines


def cmd_resync(client: LoRASyncClient, args, failed: dict) -> list[str]:
    """Stateless: the fleet's newest version of the name, pushed from DIR to every server
    that lacks it (a restarted server, one that missed a push)."""
    held = {server.url: max(listing.versions_by_name().get(args.name, ()), default=0)
            for server, listing in per_server(
                client, lambda s: client._listing(s, client.timeout), failed)}
    newest = max(held.values(), default=0)
    if newest == 0 and not failed:
        raise UsageError(f"no server holds {args.name!r}: use push")
    served = naming.versioned(args.name, newest)
    lines = []
    for server in client.servers:
        if server.url in failed:
            lines.append(failure_line(server.url, failed[server.url]))
        elif newest == 0 or held[server.url] == newest:
            lines.append(f"{server.url}  has {served if newest else 'no version'}")
        else:
            with LoRASyncClient([server], api_key=args.api_key_value,
                                timeout=client.timeout, lease_ahead=False) as one:
                [r] = one.push(args.adapter, args.name, newest, on_error="skip")
            if r.ok:
                lines.append(f"{server.url}  pushed {served}")
            else:
                failed[server.url] = r.error
                lines.append(failure_line(server.url, r.error))
    return lines


def cmd_rollback(client: LoRASyncClient, args, failed: dict) -> list[str]:
    """Points the alias at VERSION on every server (the servers' own check: a version they
    no longer hold is refused, naming the ones they do)."""
    version = None if args.version == "newest" else args.version_number
    body = {"lora_name": args.name, "version": version, "pin": args.pin}

    def point(server: Server) -> dict:
        return http.call("POST", server.route(ALIAS_ROUTE), json_body=body,
                         headers=client.headers, timeout=client.timeout)[0]
    lines = []
    for server, reply in per_server(client, point, failed, lines):
        lines.append(f"{server.url}  {reply.get('lora_name')} -> {reply.get('alias_target')}"
                     + (" (pinned)" if reply.get("pinned") else ""))
    return lines


COMMANDS = {"push": cmd_push, "ls": cmd_ls, "info": cmd_info, "resync": cmd_resync,
            "rollback": cmd_rollback}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lora-sync", description=__doc__.split("\n\n")[0])
    p.add_argument("--server", action="append", metavar="URL",
                   help="a server's base URL, e.g. http://127.0.0.1:8000 (repeat for several; "
                        "default: LORA_SYNC_SERVERS, URLs separated by commas and/or spaces)")
    p.add_argument("--engine", choices=("auto", *ENGINES), default="auto")
    p.add_argument("--api-key", help="the servers' LORA_SYNC_API_KEY (default: that variable)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a command waits for the servers, each call as a whole")
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
                           choices=["auto", *(n for n, t in TRANSPORTS.items() if t.per_server)])
    sub.add_parser("ls", help="versions, alias and requests in flight per name (a tenant's "
                              "key: its own names)")
    c = sub.add_parser("rollback", help="point NAME's alias at a version the servers hold")
    c.add_argument("name")
    c.add_argument("version", help="a version number, or 'newest' to follow pushes again")
    c.add_argument("--pin", action="store_true",
                   help="keep the alias there across pushes (until the next rollback)")
    sub.add_parser("info", help="workers, limits and instance id of each server")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    args.api_key_value = args.api_key or os.environ.get(API_KEY_ENV)
    failed: dict[str, LoRASyncError] = {}  # server url -> why it failed
    lines = []
    try:
        if args.command in ("push", "resync"):
            args.adapter = read_adapter(args.dir)  # bad input: nothing is sent anywhere
        if args.command == "rollback":
            check_rollback_args(args)
        servers = find_servers(args, failed)
        if servers:
            # One command, then exit: no lease to ready for a next push.
            with LoRASyncClient(servers, api_key=args.api_key_value,
                                timeout=args.timeout, lease_ahead=False) as client:
                lines = COMMANDS[args.command](client, args, failed)
        lines += [failure_line(u, e) for u, e in failed.items()
                  if u not in {s.url for s in servers}]  # engine detection failed
    except UsageError as e:
        print(f"lora-sync: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except LoRASyncError as e:
        failed[e.server or "lora-sync"] = e
    if lines:
        print("\n".join(lines))
    for url, e in failed.items():
        named = e.message if url in e.message else f"{url}: {e.message}"
        print(f"lora-sync: error: {e.code}: {named}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
