"""The package layout that docs/layout.md promises: imports point one way, no module imports itself
back through others, modules stay small.

Parses every module with ``ast`` (nothing is imported), so a wrong edge fails here with its file and line
instead of surfacing later as an import cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"peer": "hlbp.peer", "protocol": "hlbp.protocol", "cli": "hlbp.cli", "bootstrap": "hlbp.bootstrap"}

# what each sub-package of hlbp.peer may import of the others (its own modules always)
LOWER = {
    "common": set(),
    "data": {"common"},
    "model": {"common"},
    "light": {"common"},  # the light client runs without hivemind, so it may not import net (hivemind) or above
    "train": {"common", "data", "model"},
    "net": {"common", "data", "model"},
    "rounds": {"common", "data", "model", "train", "net"},
    "swarm": {"common", "data", "model", "train", "net"},
    "node": {"common", "data", "model", "train", "net", "rounds", "swarm", "light"},
    "sim": {"common", "data", "model", "train", "net", "rounds", "swarm"},
    "bench": {"common", "data", "model", "train", "net", "rounds", "swarm", "sim"},
}
MAX_LINES = 500
LONG_REASON = "Longer than 500 lines because"


def _modules() -> list[tuple[Path, str]]:
    out = []
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out.append((path, ".".join([package, *parts])))
    return out


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every absolute ``hlbp.*`` module a file imports, at any depth (function-level imports count too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
    return [(line, name) for line, name in found if name == "hlbp" or name.startswith("hlbp.")]


def _imported_modules(path: Path, known: set[str]) -> set[str]:
    """The hlbp modules a file imports, at any depth: ``from pkg import name`` counts as ``pkg.name`` where that is
    a module, else as ``pkg``; names that are no module of the tree (third-party, missing) are left out."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & known


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan): every import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(out)


def _violation(importer: str, imported: str) -> str | None:
    """Why ``importer`` may not import ``imported``, or None if it may."""
    if importer.startswith("hlbp.protocol"):
        return None if imported.startswith("hlbp.protocol") else "protocol is pure and imports nothing else of hlbp"
    if importer.startswith("hlbp.peer") and imported.startswith(("hlbp.cli", "hlbp.bootstrap")):
        return "peer never imports the cli or the bootstrap"
    if importer.startswith("hlbp.bootstrap") and imported.startswith("hlbp.cli"):
        return "the bootstrap never imports the cli"
    mine, theirs = importer.split("."), imported.split(".")
    if mine[:2] == ["hlbp", "peer"] and theirs[:2] == ["hlbp", "peer"]:
        if len(mine) < 3:
            return None  # hlbp.peer's own __init__
        if len(theirs) < 3 or theirs[2] not in LOWER:
            return f"{imported} is not a sub-package module of hlbp.peer"
        if mine[2] != theirs[2] and theirs[2] not in LOWER[mine[2]]:
            return f"peer.{mine[2]} may import only {sorted(LOWER[mine[2]])} of the other sub-packages"
    return None


def test_every_peer_module_lives_in_a_known_sub_package() -> None:
    stray = [str(p.relative_to(ROOT)) for p, name in _modules()
             if name.startswith("hlbp.peer.") and name.split(".")[2] not in LOWER]
    assert not stray, f"modules outside the sub-packages of docs/layout.md: {stray}"


def test_imports_point_downward() -> None:
    bad = []
    for path, module in _modules():
        for line, imported in _imports(path):
            why = _violation(module, imported)
            if why:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {imported}: {why}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    modules = _modules()
    known = {name for _path, name in modules}
    graph = {name: _imported_modules(path, known) - {name} for path, name in modules}
    cycles = _cycles(graph)
    assert not cycles, "modules that import each other (directly or through others):\n" + "\n".join(
        " <-> ".join(cycle) for cycle in cycles)


@pytest.mark.parametrize(("graph", "cycles"), [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}}, [["a", "b", "c"], ["d", "e"]]),
])
def test_the_cycle_finder_itself(graph: dict[str, set[str]], cycles: list[list[str]]) -> None:
    assert _cycles(graph) == cycles


@pytest.mark.parametrize(("importer", "imported", "allowed"), [
    ("hlbp.peer.model.decoder", "hlbp.peer.rounds.outer", False),
    ("hlbp.peer.train.trainer", "hlbp.peer.net.control", False),
    ("hlbp.peer.rounds.loop", "hlbp.peer.train.trainer", True),
    ("hlbp.peer.sim.launcher", "hlbp.peer.bench.report", False),
    ("hlbp.protocol.manifest", "hlbp.peer.common.errors", False),
    ("hlbp.peer.net.control", "hlbp.cli.main", False),
])
def test_the_rule_itself(importer: str, imported: str, allowed: bool) -> None:
    assert (_violation(importer, imported) is None) == allowed


def test_modules_stay_small_or_say_why() -> None:
    long = []
    for path, _module in _modules():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > MAX_LINES and LONG_REASON not in (ast.get_docstring(ast.parse(text)) or ""):
            long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert not long, f"modules over {MAX_LINES} lines whose docstring does not say why:\n" + "\n".join(long)


# ---------------------------------------------------------------------------------------------------------------
# Objects: composed parts with one owner each, not one object spread over mixins
# ---------------------------------------------------------------------------------------------------------------

MAX_CLASS_MEMBERS = 60  # methods and attributes of a class, its own bases' included
BIG_REASON = "More than 60 members because"
# private names of other libraries' objects that hlbp has to reach, each with why
FOREIGN_PRIVATES = {
    "os._exit": "the documented way to leave a forked child without running the parent's handlers",
    "torch._foreach_mul_": "torch's fused in-place multiply of a tensor list",
    "DHT._get_p2p_daemon_listen_maddr": "hivemind's only way to learn the daemon's listening address",
    "hm_asyncio._AsyncContextWrapper": "hivemind's import-time process-shared lock, renewed in each forked child",
}


def _classes() -> dict[str, list[tuple[Path, ast.ClassDef]]]:
    out: dict[str, list[tuple[Path, ast.ClassDef]]] = {}
    for path, _module in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append((path, node))
    return out


def _members(node: ast.ClassDef) -> set[str]:
    """A class's own methods, class attributes and the attributes its methods set on ``self``."""
    names = {f.name for f in node.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
    names |= {f.target.id for f in node.body if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)}
    names |= {t.id for f in node.body if isinstance(f, ast.Assign) for t in f.targets if isinstance(t, ast.Name)}
    names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
              and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return names


def _own_bases(node: ast.ClassDef, ours: dict[str, list[tuple[Path, ast.ClassDef]]]) -> list[str]:
    return [name for base in node.bases if (name := ast.unparse(base).split(".")[-1]) in ours]


def _all_members(name: str, ours: dict[str, list[tuple[Path, ast.ClassDef]]], seen: frozenset[str] = frozenset()) -> set[str]:
    _path, node = ours[name][0]
    members = _members(node)
    for base in _own_bases(node, ours):
        if base not in seen:
            members |= _all_members(base, ours, seen | {name})
    return members


def test_no_class_inherits_from_two_of_ours() -> None:
    ours = _classes()
    mixed = [f"{path.relative_to(ROOT)}: {node.name}({', '.join(_own_bases(node, ours))})"
             for defs in ours.values() for path, node in defs if len(_own_bases(node, ours)) > 1]
    assert not mixed, "classes built from several of ours (compose parts instead):\n" + "\n".join(mixed)


def test_classes_stay_small_or_say_why() -> None:
    ours = _classes()
    big = []
    for name, defs in ours.items():
        path, node = defs[0]
        count = len(_all_members(name, ours))
        if count > MAX_CLASS_MEMBERS and BIG_REASON not in (ast.get_docstring(node) or ""):
            big.append(f"{path.relative_to(ROOT)}: {name} has {count} members")
    assert not big, (f"classes over {MAX_CLASS_MEMBERS} methods and attributes (bases included) whose docstring "
                     "does not say why; what second concern do they hold?\n" + "\n".join(big))


def test_no_module_touches_another_objects_privates() -> None:
    touched = []
    for path, _module in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            if ast.unparse(node) not in FOREIGN_PRIVATES:
                touched.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not touched, "private attributes of another object (give it a public method):\n" + "\n".join(touched)
