#!/usr/bin/env python3
"""Checks that the private engine APIs lora-sync touches still exist in given engine releases.

    python scripts/drift_check.py vllm==0.32.0 vllm==0.33.0 sglang==0.5.23 [--report FILE]

Without arguments it checks every version lora_sync/server/pins.py accepts. Each argument is
NAME==VERSION (its wheel is downloaded without dependencies into $LORA_SYNC_WHEEL_CACHE,
default ~/.cache/lora-sync/wheels) or NAME==VERSION@PATH (PATH is a wheel or an unpacked
source tree, e.g. a doctored copy in a test). The engine's sources are read with `ast`, never
imported: a release that cannot be installed here (vLLM 0.33.0 has no CPU build) can still
be checked. The version table's mirror check (MIRRORS) is described at `mirror_cells`.

What is checked comes from the `TOUCHED` literal in vllm_ext/engine_api.py,
sglang_ext/engine_api.py and, for TRL (`trl==1.16.0`, the trainer lora_sync/integrations/trl.py
subclasses), lora_sync/integrations/trl.py and lora_sync/integrations/trl_cpu.py (read with ast too:
importing them would import the engine). Each entry is a string:

    "module"                          the module exists
    "module:Name.attr"                a class / function / attribute, looked up through the
                                      class's bases; `self.attr = ...` in a method counts, and
                                      for a function, `<obj>.attr = ...` in its body does
    "module:Name.meth(a, b, *, c)"    also callable like that: positional parameters a, b in
                                      that order, keyword c accepted, nothing else required
    "... [0.32.0]"                    only used with these engine versions

The coverage check makes the list hard to forget: every `from <engine>... import` in
engine_api.py, every private attribute (`x._name`, or "_name" as a string for getattr) and
every dotted "<engine>.x.y" string must match an entry, and so must every private method of a
class derived from an engine class (an override); private names inside the version table
`BY_VERSION[v]` must match an entry that applies to v.
"""
from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENGINE_FILES = {"vllm": REPO / "vllm_ext" / "engine_api.py",
                "sglang": REPO / "sglang_ext" / "engine_api.py",
                "trl": REPO / "lora_sync" / "integrations" / "trl.py"}
# Further files with a TOUCHED list of the same package, checked with it.
MORE_FILES = {"trl": (REPO / "lora_sync" / "integrations" / "trl_cpu.py",)}  # TRL on CPU (tests, demo)
PINS_ENGINES = {"vLLM": "vllm", "SGLang": "sglang", "TRL": "trl"}
LIST_NAME, TABLE_NAME, MIRRORS_NAME = "TOUCHED", "BY_VERSION", "MIRRORS"
# Private attributes lora-sync itself sets on engine objects. Not for TRL: its trainer has a
# `_lora_sync` of its own, and our subclass keeps its state in public `lora_sync_*` names.
OWN_PREFIX = {"vllm": "_lora_sync", "sglang": "_lora_sync"}
CACHE_ENV = "LORA_SYNC_WHEEL_CACHE"


# ---------------------------------------------------------------- the TOUCHED entries
@dataclass(frozen=True)
class Entry:
    text: str
    module: str
    path: tuple[str, ...]            # dotted name inside the module, () for the module
    positional: tuple[str, ...] | None = None   # None: not called
    keywords: tuple[str, ...] = ()
    versions: tuple[str, ...] = ()   # () = every version

    def applies(self, version: str) -> bool:
        return not self.versions or version in self.versions

    @property
    def dotted(self) -> str:
        return ".".join((self.module,) + self.path)


_ENTRY = re.compile(r"^(?P<mod>[\w.]+)(?::(?P<path>[\w.]+))?(?:\((?P<args>[^)]*)\))?"
                    r"(?:\s*\[(?P<vers>[^\]]+)\])?$")


def parse_entry(text: str) -> Entry:
    m = _ENTRY.match(text.strip())
    if m is None:
        raise ValueError(f"malformed {LIST_NAME} entry: {text!r}")
    positional, keywords = None, ()
    if m["args"] is not None:
        names = [a.strip() for a in m["args"].split(",") if a.strip()]
        star = names.index("*") if "*" in names else len(names)
        positional, keywords = tuple(names[:star]), tuple(names[star + 1:])
    versions = tuple(v.strip() for v in m["vers"].split(",")) if m["vers"] else ()
    return Entry(text, m["mod"], tuple(m["path"].split(".")) if m["path"] else (),
                 positional, keywords, versions)


def module_literal(path: Path, name: str):
    """The value of `name = <literal>` at the top of a Python file, without importing it."""
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) and node.value else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)
    return None


def touched(path: Path) -> list[Entry]:
    entries = module_literal(path, LIST_NAME)
    if not entries:
        raise ValueError(f"{path} has no {LIST_NAME} list")
    return [parse_entry(e) for e in entries]


# ---------------------------------------------------------------- engine sources
class SourceTree:
    """Python sources of a wheel (zip) or of an unpacked tree, by module name."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._zip = zipfile.ZipFile(self.path) if self.path.is_file() else None

    def _read(self, rel: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(rel).decode("utf-8")
            except KeyError:
                return None
        p = self.path / rel
        return p.read_text("utf-8") if p.is_file() else None

    @lru_cache(maxsize=None)
    def module(self, name: str) -> tuple[ast.Module, bool] | None:
        """(parsed module, is a package) or None."""
        base = name.replace(".", "/")
        for rel, is_pkg in ((base + ".py", False), (base + "/__init__.py", True)):
            text = self._read(rel)
            if text is not None:
                return ast.parse(text), is_pkg
        return None


def _body_defs(body):
    """Statements of a module or class body, looking into if/try blocks (TYPE_CHECKING...)."""
    for node in body:
        if isinstance(node, (ast.If, ast.Try)):
            yield from _body_defs(node.body)
            yield from _body_defs(node.orelse)
            for h in getattr(node, "handlers", []):
                yield from _body_defs(h.body)
            yield from _body_defs(getattr(node, "finalbody", []))
        else:
            yield node


def _targets(node) -> list:
    if isinstance(node, ast.Assign):
        out = []
        for t in node.targets:
            out += t.elts if isinstance(t, ast.Tuple) else [t]
        return out
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


@dataclass
class Found:
    kind: str                   # module / class / function / value / dynamic
    node: ast.AST | None = None
    module: str = ""            # module the node lives in
    is_method: bool = False
    note: str = ""


class Resolver:
    def __init__(self, tree: SourceTree):
        self.tree = tree

    def _absolute(self, module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = module.split(".")
        base = parts if is_pkg else parts[:-1]
        base = base[:len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def top(self, module: str, name: str, depth: int = 0) -> Found | None:
        """A top-level name of a module, following `from x import name` re-exports."""
        parsed = self.tree.module(module)
        if parsed is None or depth > 10:
            return None
        tree, is_pkg = parsed
        found = None
        for node in _body_defs(tree.body):
            if isinstance(node, ast.ClassDef) and node.name == name:
                found = Found("class", node, module)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                found = Found("function", node, module)
            elif any(isinstance(t, ast.Name) and t.id == name for t in _targets(node)):
                found = found or Found("value", node, module)
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if (a.asname or a.name) == name:
                        src = self._absolute(module, is_pkg, node)
                        found = self.top(src, a.name, depth + 1) or \
                            self.as_module(f"{src}.{a.name}") or found
        if found is None and self.as_module(f"{module}.{name}"):
            return self.as_module(f"{module}.{name}")
        return found

    def as_module(self, name: str) -> Found | None:
        return Found("module", None, name) if self.tree.module(name) else None

    def bases(self, cls: Found) -> list[Found]:
        out = []
        for b in cls.node.bases:
            if isinstance(b, ast.Subscript):  # Generic[T], LRUCache[int, T]
                b = b.value
            if isinstance(b, ast.Name):
                f = self.top(cls.module, b.id)
                if f is not None and f.kind == "class":
                    out.append(f)
        return out

    def mro(self, cls: Found) -> list[Found]:
        seen, order, todo = set(), [], [cls]
        while todo:
            c = todo.pop(0)
            if (c.module, c.node.name) not in seen:
                seen.add((c.module, c.node.name))
                order.append(c)
                todo += self.bases(c)
        return order

    def member(self, cls: Found, name: str) -> Found | None:
        """A class attribute, method or `self.name = ...` instance attribute, through the
        bases; a class with `__getattr__` answers if the module names it in a string."""
        dynamic = None
        for c in self.mro(cls):
            instance = None
            for node in _body_defs(c.node.body):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if node.name == name:
                        return Found("function", node, c.module, is_method=True)
                    if node.name == "__getattr__":
                        dynamic = dynamic or c
                    if instance is None and _assigns_attr(node, name, self_only=True):
                        instance = Found("value", node, c.module)
                elif isinstance(node, ast.ClassDef) and node.name == name:
                    return Found("class", node, c.module)
                elif any(isinstance(t, ast.Name) and t.id == name for t in _targets(node)):
                    return Found("value", node, c.module)
            if instance is not None:
                return instance
        if dynamic is not None and _names_string(self.tree.module(dynamic.module)[0], name):
            return Found("dynamic", None, dynamic.module,
                         note=f"via {dynamic.node.name}.__getattr__, named in its module")
        return None

    def lookup(self, entry: Entry) -> tuple[Found | None, str]:
        """(what the entry names, or None with the reason)."""
        if self.tree.module(entry.module) is None:
            return None, f"no module {entry.module}"
        cur = Found("module", None, entry.module)
        for i, part in enumerate(entry.path):
            where = ".".join(entry.path[:i]) or entry.module
            if cur.kind == "module":
                nxt = self.top(cur.module, part)
            elif cur.kind == "class":
                nxt = self.member(cur, part)
            elif cur.kind == "function" and _assigns_attr(cur.node, part, self_only=False):
                nxt = Found("value", cur.node, cur.module)
            else:
                nxt = None
            if nxt is None:
                kind = "attribute or method" if cur.kind == "class" else "name"
                return None, f"no {kind} `{part}` in {where}"
            cur = nxt
        return cur, ""


def _assigns_attr(func, name: str, self_only: bool) -> bool:
    """Whether a function assigns `self.name` (or, not self_only, `<any name>.name`)."""
    owner = func.args.args[0].arg if func.args.args else None
    for node in ast.walk(func):
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name) \
                    and (not self_only or t.value.id == owner):
                return True
    return False


def _names_string(tree: ast.Module, name: str) -> bool:
    return any(isinstance(n, ast.Constant) and n.value == name for n in ast.walk(tree))


# ---------------------------------------------------------------- call signatures
@dataclass
class Signature:
    positional: list[tuple[str, bool]] = field(default_factory=list)  # (name, has default)
    keyword_only: list[tuple[str, bool]] = field(default_factory=list)
    var_positional: bool = False
    var_keyword: bool = False


def _function_signature(node, drop_first: bool) -> Signature:
    a = node.args
    pos = a.posonlyargs + a.args
    defaults = [False] * (len(pos) - len(a.defaults)) + [True] * len(a.defaults)
    sig = Signature([(p.arg, d) for p, d in zip(pos, defaults)],
                    [(k.arg, d is not None) for k, d in zip(a.kwonlyargs, a.kw_defaults)],
                    a.vararg is not None, a.kwarg is not None)
    if drop_first and sig.positional:
        sig.positional.pop(0)
    return sig


def _decorators(node) -> set[str]:
    return {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "")
            for d in node.decorator_list}


def signature(resolver: Resolver, found: Found) -> Signature | None:
    """How `found` is called, or None when it cannot be read (a plain value)."""
    if found.kind == "function":
        return _function_signature(found.node, found.is_method and
                                   "staticmethod" not in _decorators(found.node))
    if found.kind != "class":
        return None
    init = resolver.member(found, "__init__")
    if init is not None and init.kind == "function":
        return _function_signature(init.node, True)
    # A dataclass / msgspec Struct / pydantic model: the constructor takes its fields.
    sig, kw_only = Signature(), False
    for c in reversed(resolver.mro(found)):
        kw_only |= any(k.arg == "kw_only" and getattr(k.value, "value", False)
                       for k in c.node.keywords)
        for node in _body_defs(c.node.body):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and "ClassVar" not in ast.unparse(node.annotation):
                sig.positional.append((node.target.id, node.value is not None))
    if kw_only:
        sig.keyword_only, sig.positional = sig.positional, []
    return sig


def call_problems(sig: Signature, entry: Entry) -> list[str]:
    """Why calling with `entry`'s arguments would fail ([] when it fits)."""
    problems = []
    names = [n for n, _ in sig.positional]
    if len(entry.positional) > len(names) and not sig.var_positional:
        problems.append(f"takes {len(names)} positional argument(s), we pass "
                        f"{len(entry.positional)}")
    for i, ours in enumerate(entry.positional):
        if i < len(names) and names[i] != ours:
            problems.append(f"positional #{i + 1} is `{names[i]}`, we assume `{ours}`")
    by_keyword = set(names[len(entry.positional):]) | {n for n, _ in sig.keyword_only}
    for kw in entry.keywords:
        if kw not in by_keyword and not sig.var_keyword:
            problems.append(f"no parameter `{kw}`")
    passed = set(entry.keywords) | set(names[:len(entry.positional)])
    required = [n for n, d in sig.positional[len(entry.positional):] + sig.keyword_only
                if not d and n not in passed]
    if required:
        problems.append("requires " + ", ".join(f"`{n}`" for n in required) + ", not passed")
    return problems


def check_entry(resolver: Resolver, entry: Entry) -> tuple[bool, str]:
    """(ok, note) for one entry against one source tree."""
    found, why = resolver.lookup(entry)
    if found is None:
        return False, why
    note = found.note or "present"
    if entry.positional is None:
        return True, note
    sig = signature(resolver, found)
    if sig is None:
        return True, f"{note}; signature not readable"
    problems = call_problems(sig, entry)
    if problems:
        return False, "; ".join(problems)
    return True, f"{note}, call fits"


# ---------------------------------------------------------------- coverage of engine_api.py
def coverage_problems(path: Path, package: str) -> list[str]:
    """Engine touches in `path` that its TOUCHED list does not name."""
    entries = touched(path)
    tree = ast.parse(path.read_text())
    table = module_literal(path, TABLE_NAME) or {}
    listed_names = {p for e in entries for p in e.path}
    problems = []
    # MIRRORS holds a name prefix and a function to read, not a touch of its own.
    mirrors = {id(n) for a in tree.body if isinstance(a, ast.Assign)
               and any(getattr(t, "id", None) == MIRRORS_NAME for t in a.targets)
               for n in ast.walk(a.value)}

    def private(name) -> bool:
        own = OWN_PREFIX.get(package)
        return name.startswith("_") and not name.startswith("__") \
            and not (own and name.startswith(own))

    # Classes derived from an engine class: their private methods override (or add to) it.
    engine_names = {a.asname or a.name for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom)
                    and (node.module or "").split(".")[0] == package for a in node.names}
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id in engine_names
                                                 for b in cls.bases):
            for item in cls.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                        and private(item.name) and item.name not in listed_names:
                    problems.append(f"method `{cls.name}.{item.name}` (line {item.lineno}) of a "
                                    f"class derived from {package} is not in {LIST_NAME}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == package:
            for a in node.names:
                if not any(e.module == node.module and e.path[:1] == (a.name,) for e in entries):
                    problems.append(f"`from {node.module} import {a.name}` is not in {LIST_NAME}")
        elif isinstance(node, ast.Attribute) and private(node.attr) \
                and node.attr not in listed_names:
            problems.append(f"private attribute `.{node.attr}` (line {node.lineno}) is not in "
                            f"{LIST_NAME}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in mirrors:
            s = node.value
            if re.fullmatch(r"_\w+", s) and private(s) and s not in listed_names:
                problems.append(f"private name {s!r} (line {node.lineno}) is not in {LIST_NAME}")
            elif re.fullmatch(rf"{package}(\.\w+)+", s) and \
                    not any(e.dotted == s or e.module == s for e in entries):
                problems.append(f"engine path {s!r} (line {node.lineno}) is not in {LIST_NAME}")
    for version, row in table.items():
        for s in _strings(row):
            if re.fullmatch(r"_\w+", s) and private(s) and not any(
                    s in e.path and e.applies(version) for e in entries):
                problems.append(f"{TABLE_NAME}[{version!r}] uses {s!r}, not in {LIST_NAME} "
                                f"for {version}")
    for e in entries:
        for v in e.versions:
            if table and v not in table:
                problems.append(f"{LIST_NAME} entry {e.text!r} names {v}, not in {TABLE_NAME}")
    return problems


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple, set)):
        for v in value:
            yield from _strings(v)


# ---------------------------------------------------------------- wheels
def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lora-sync" / "wheels")


def _cached_wheel(dist: str, version: str, cache: Path) -> Path | None:
    stem = re.sub(r"[-_.]+", "_", dist).lower()
    for p in sorted(cache.glob("*.whl")):
        name, ver = p.name.split("-")[:2]
        if re.sub(r"[-_.]+", "_", name).lower() == stem and ver == version:
            return p
    return None


def fetch_wheel(dist: str, version: str, cache: Path | None = None) -> Path:
    """The engine's wheel, downloaded once (no dependencies: only its own sources are read)."""
    cache = cache or cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    wheel = _cached_wheel(dist, version, cache)
    if wheel is None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--python-version", "3.11", "--quiet", "-d", str(cache), f"{dist}=={version}"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        wheel = _cached_wheel(dist, version, cache)
        if run.returncode != 0 or wheel is None:
            tail = (run.stderr or run.stdout).strip().splitlines()[-2:]
            raise RuntimeError(f"could not download {dist}=={version}: {' / '.join(tail)}")
    return wheel


# ---------------------------------------------------------------- running it
@dataclass
class Target:
    dist: str
    version: str
    path: Path | None = None   # None: download the wheel

    @property
    def engine(self) -> str:
        return re.split(r"[-_]", self.dist)[0].lower()

    @property
    def label(self) -> str:
        return f"{self.dist} {self.version}"


def supported_targets() -> list[str]:
    """NAME==VERSION for every version the start-up check accepts (lora_sync.server.pins,
    which imports no engine)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from lora_sync.server.pins import SUPPORTED as pins
    return [f"{PINS_ENGINES[engine]}=={v}" for engine, versions in pins.items() for v in versions]


def parse_target(spec: str) -> Target:
    m = re.fullmatch(r"([\w.-]+)==([\w.+-]+?)(?:@(.+))?", spec)
    if m is None:
        raise ValueError(f"expected NAME==VERSION or NAME==VERSION@PATH, got {spec!r}")
    target = Target(m[1], m[2], Path(m[3]) if m[3] else None)
    if target.engine not in ENGINE_FILES:
        raise ValueError(f"unknown engine {target.dist!r} (known: {', '.join(ENGINE_FILES)})")
    return target


@dataclass
class Result:
    target: Target
    source: str
    cells: dict[str, tuple[bool | None, str]]   # entry text -> (ok, note); None: not used

    @property
    def failures(self) -> list[str]:
        return [f"{self.target.label}: `{t}` missing: {note}"
                for t, (ok, note) in self.cells.items() if ok is False]


def mirror_cells(resolver: Resolver, api_file: Path, version: str) -> dict:
    """MIRRORS = {key: ("module:Func", prefix)}: BY_VERSION[version][key] must list the
    `x.<prefix>...(...)` calls the engine function makes in this release, in order (so a check
    upstream adds to its own loader shows up, not only one it removes)."""
    table = module_literal(api_file, TABLE_NAME) or {}
    cells = {}
    for key, (func, prefix) in (module_literal(api_file, MIRRORS_NAME) or {}).items():
        label = f"{TABLE_NAME}[version][{key!r}] == the {prefix}* calls of {func}"
        found, why = resolver.lookup(parse_entry(func))
        if found is None or found.kind != "function":
            cells[label] = (False, why or f"{func} is not a function")
            continue
        calls = sorted((n.lineno, n.col_offset, n.func.attr) for n in ast.walk(found.node)
                       if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                       and n.func.attr.startswith(prefix))
        upstream = tuple(c[2] for c in calls)
        ours = tuple(table.get(version, {}).get(key, ()))
        cells[label] = (True, "matches") if ours == upstream else \
            (False, f"release calls {upstream}, {TABLE_NAME} has {ours or 'no row'}")
    return cells


def api_files(engine: str) -> list[Path]:
    return [ENGINE_FILES[engine], *MORE_FILES.get(engine, ())]


def check_target(target: Target, api_file: Path | None = None) -> Result:
    path = target.path or fetch_wheel(target.dist, target.version)
    resolver = Resolver(SourceTree(path))
    version = target.version.split("+")[0]  # 0.32.0+cpu is 0.32.0
    cells = {}
    for api_file in [api_file] if api_file else api_files(target.engine):
        for e in touched(api_file):
            cells[e.text] = check_entry(resolver, e) if e.applies(version) else \
                (None, "not used")
        cells.update(mirror_cells(resolver, api_file, version))
    return Result(target, Path(path).name, cells)


def _cell(ok: bool | None, note: str) -> str:
    note = note.replace("|", "\\|")
    return {True: note, False: f"**MISSING**: {note}", None: f"_{note}_"}[ok]


def report(results: list[Result], command: str, coverage: list[str]) -> str:
    lines = ["# Engine API drift", "",
             f"Written by `{command}` (scripts/drift_check.py): every private engine symbol "
             "lora-sync touches (the `TOUCHED` lists in `vllm_ext/engine_api.py`, "
             "`sglang_ext/engine_api.py` and, for TRL's trainer, "
             "`lora_sync/integrations/trl.py` and `lora_sync/integrations/trl_cpu.py`), looked up in each "
             "release's wheel by reading its sources with `ast`, without importing them. "
             "\"call fits\": the parameters we pass exist, in the positions we pass them, and "
             "nothing else is required.", "",
             "Coverage of the lists (every engine import, private attribute, engine path "
             "and private method override in those files is listed): "
             + ("complete." if not coverage else "**incomplete**: " + "; ".join(coverage)), ""]
    for engine, api in ENGINE_FILES.items():
        group = [r for r in results if r.target.engine == engine]
        if not group:
            continue
        lines += ["## " + ", ".join(str(f.relative_to(REPO)) for f in api_files(engine)), "",
                  "Sources: " + ", ".join(f"{r.target.label} = `{r.source}`" for r in group), "",
                  "| symbol | " + " | ".join(r.target.label for r in group) + " |",
                  "|---|" + "---|" * len(group)]
        for text in group[0].cells:
            lines.append(f"| `{text}` | " + " | ".join(_cell(*r.cells[text]) for r in group)
                         + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="*", metavar="NAME==VERSION[@PATH]",
                    help="default: every version lora_sync/server/pins.py accepts")
    ap.add_argument("--report", type=Path, help="write the markdown table here")
    args = ap.parse_args(argv)
    args.targets = args.targets or supported_targets()
    coverage = [f"{api.relative_to(REPO)}: {p}" for engine in ENGINE_FILES
                for api in api_files(engine) for p in coverage_problems(api, engine)]
    failures, results = list(coverage), []
    for spec in args.targets:
        result = check_target(parse_target(spec))
        ok = sum(c[0] is True for c in result.cells.values())
        print(f"{result.target.label}: {ok}/{sum(c[0] is not None for c in result.cells.values())}"
              f" checks pass ({result.source})")
        failures += result.failures
        results.append(result)
    if args.report:
        shown = " ".join(["python scripts/drift_check.py"] + args.targets
                         + ["--report", str(args.report)])
        args.report.write_text(report(results, shown, coverage))
    for f in failures:
        print("DRIFT:", f, file=sys.stderr)
    print("ok" if not failures else f"{len(failures)} problem(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
