"""The package's layers, checked from its imports (every import, also inside functions).

Dependencies point one way: the entry points (manager, CLI) and the shims use the lifecycle
core, which uses the DCP writer and reader, which use the tiers and the upload queue, which use
the backends; policy and format modules do no I/O and
import neither tiers nor backends; nothing but the CLI and the shims themselves imports a shim.
The CLI is a package nothing else imports, and inside it the dependencies point one way too:
``cli/__init__`` (parsing) -> the command modules -> ``cli/_base`` and ``cli/_context`` -> the
library; no module of it imports ``dcp_tiered.cli`` back, and it has no import cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dcp_tiered

PACKAGE = Path(__file__).resolve().parents[1] / "dcp_tiered"

# Layers are packages where the tree has them (policy/, backends/, tiers/, shims/), and these
# modules beside them: formats and helpers every layer may use count as policy.
POLICY = {
    "config",
    "errors",
    "safe_unpickle",
    "rank_state",
    "agreement",
    "item_frame",
    "batch_copy",
    "tensor_versions",
}
DCP = {
    "planner",
    "load_planner",
    "item_writer",
    "item_layout",
    "writer",
    "reader",
    "reader_checks",
    "staging",
}  # torch's StorageWriter/StorageReader, and staging
LIFECYCLE = {"lifecycle", "runs"}  # what every entry point shares around a save and a restore
ENTRY_POINTS = {"manager"}  # and the cli/ package


def imports_of(path: Path) -> set[str]:
    """Modules of dcp_tiered that ``path`` imports, relative to the package ("backends.local")."""
    module = path.relative_to(PACKAGE).with_suffix("").parts
    package = module[:-1]  # of a module and of a package's __init__ alike
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - (node.level - 1)])
            elif node.module and node.module.startswith("dcp_tiered"):
                base = []
            else:
                continue
            target = base + ([p for p in (node.module or "").split(".") if p and p != "dcp_tiered"])
            names = [a.name for a in node.names]
            for name in names:  # "from . import layout" imports the module layout
                candidate = [*target, name]
                if (
                    PACKAGE.joinpath(*candidate).with_suffix(".py").exists()
                    or PACKAGE.joinpath(*candidate).is_dir()
                ):
                    found.add(".".join(candidate))
                elif target:
                    found.add(".".join(target))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("dcp_tiered."):
                    found.add(alias.name.removeprefix("dcp_tiered."))
    return {m for m in found if m}


MODULES = {".".join(p.relative_to(PACKAGE).with_suffix("").parts): p for p in PACKAGE.rglob("*.py")}


def _layer(module: str) -> str:
    top = module.split(".")[0]
    if top == "cli":
        return "entry"
    if top in ("shims", "backends", "tiers", "policy"):
        return {"tiers": "tiers", "policy": "policy"}.get(top, top)
    if top in ("writer", "reader"):  # packages: DCP's call sequence and its private modules
        return "dcp"
    if top == "lifecycle":  # a package: the save core and its helpers
        return "lifecycle"
    if top == "manager":  # a package: the CheckpointManager and its helpers
        return "entry"
    for name, members in (
        ("policy", POLICY),
        ("dcp", DCP),
        ("lifecycle", LIFECYCLE),
        ("entry", ENTRY_POINTS),
    ):
        if module in members:
            return name
    return "other"


FORBIDDEN = {  # layer -> layers it must never import
    "policy": {"backends", "tiers", "dcp", "lifecycle", "entry", "shims"},
    "backends": {"tiers", "dcp", "lifecycle", "entry", "shims"},
    "tiers": {"dcp", "lifecycle", "entry", "shims"},
    "dcp": {"lifecycle", "entry", "shims"},
    "lifecycle": {"entry", "shims"},
}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers(module):
    layer = _layer(module)
    wrong = sorted(
        m for m in imports_of(MODULES[module]) if _layer(m) in FORBIDDEN.get(layer, set())
    )
    assert wrong == [], f"{module} ({layer}) imports {wrong}, against the layering"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) != "shims"))
def test_only_the_cli_and_the_shims_import_a_shim(module):
    shims = sorted(m for m in imports_of(MODULES[module]) if m.split(".")[0] == "shims")
    assert module.split(".")[0] == "cli" or shims == [], f"{module} imports {shims}"


def test_the_checker_resolves_imports_and_would_catch_a_violation():
    assert imports_of(PACKAGE / "tiers" / "local.py") == {
        "policy.layout",
        "policy.manifest",
        "policy.identity",
        "policy.records",
        "tiers.ownership",
        "tiers.local_pending",
        "tiers.local_recovery",
        "tiers.step_record",
        "backends.local",
        "errors",
    }
    assert {"policy.integrity", "backends._local_fs"} <= imports_of(
        PACKAGE / "backends" / "_local_reads.py"
    )
    assert {"backends.base", "backends._local_reads", "policy.layout"} <= imports_of(
        PACKAGE / "backends" / "local.py"
    )
    assert "backends" in FORBIDDEN[_layer("policy.layout")]
    assert _layer("backends.local") == "backends" and _layer("shims.deepspeed") == "shims"
    assert "lifecycle" in FORBIDDEN[_layer("writer")] and "entry" in FORBIDDEN["lifecycle"]
    assert _layer("writer._plan") == "dcp" and _layer("reader._local") == "dcp"
    assert {"writer._plan", "writer._commit"} <= imports_of(PACKAGE / "writer" / "__init__.py")


# ------------------------------------------------------------ the shims

# What a shim may import of dcp_tiered: the public API (the names ``dcp_tiered`` exports, and
# its public modules) and the lifecycle; never the tiers, the backends or the policy modules.
# A shim's needs of those come through ``lifecycle`` (``lifecycle.roots`` for a checkpoint
# root), its needs of the package's process helpers through ``shims._common``.
SHIM_API = {"lifecycle", "manager", "reader", "writer", "errors", "config"}
SHIM_HELPERS = {"_torch_compat", "agreement", "distributed", "rank_state"}  # shims._common's
SHIMS = sorted(m for m in MODULES if _layer(m) == "shims")


def _public_api(module: str) -> bool:
    top = module.split(".")[0]
    return top in SHIM_API and (module == top or top == "lifecycle" or module.endswith("__init__"))


def names_from_the_package(path: Path) -> set[str]:
    """What ``path`` imports from ``dcp_tiered`` itself (``from ... import RetentionPolicy``)."""
    module = path.relative_to(PACKAGE).with_suffix("").parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.module:
            if node.level == len(module):  # up to dcp_tiered/ from a shim module
                found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "dcp_tiered":
            found |= {a.name for a in node.names}
    return found


@pytest.mark.parametrize("module", SHIMS)
def test_a_shim_imports_only_the_public_and_lifecycle_api(module):
    allowed = SHIM_HELPERS if module == "shims._common" else set()
    wrong = sorted(
        m
        for m in imports_of(MODULES[module])
        if not (_public_api(m) or _layer(m) == "shims" or m in allowed)
    )
    assert wrong == [], f"{module} imports {wrong}: a shim builds on the public and lifecycle API"
    public = set(dcp_tiered.__all__)
    private = sorted(n for n in names_from_the_package(MODULES[module]) if n not in public)
    assert private == [], f"{module} imports {private} from dcp_tiered, which does not export them"


def test_the_shim_rule_sees_every_shim_and_would_catch_a_violation():
    assert {"shims.deepspeed.engine", "shims.hf.trainer", "shims.megatron.facade"} <= set(SHIMS)
    assert {"shims.torchtitan", "shims.torchtitan_ft", "shims._common"} <= set(SHIMS)
    assert not _public_api("tiers.local") and not _public_api("backends.local")
    assert not _public_api("policy.layout") and not _public_api("manager._gate")
    assert not _public_api("writer._plan") and _public_api("lifecycle.roots")
    assert "lifecycle.roots" in imports_of(PACKAGE / "shims" / "deepspeed" / "files.py")
    assert {"RetentionPolicy"} <= names_from_the_package(PACKAGE / "shims" / "torchtitan.py")


def test_the_newer_shims_sit_on_the_lifecycle_and_the_public_modules():
    """The torchtitan adapter builds on the lifecycle like the other shims; the megatron-core
    compatibility layer and loader stay inside the shims layer."""
    for module in ("torchtitan", "torchtitan_ft", "megatron.compat", "megatron.load"):
        assert _layer(f"shims.{module}") == "shims" and f"shims.{module}" in MODULES
    titan = imports_of(PACKAGE / "shims" / "torchtitan.py")
    assert "lifecycle" in titan and "writer" not in titan
    assert imports_of(PACKAGE / "shims" / "torchtitan_ft.py") == {"shims.torchtitan"}


# The private modules of the writer, reader, manager and backends packages (writer/_plan.py,
# backends/_local_reads.py ...): the package's own.
PRIVATE = {
    m
    for m in MODULES
    if m.split(".")[0] in ("writer", "reader", "manager", "backends")
    and m.split(".")[-1][:1] == "_"
    if not m.endswith(".__init__")
}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_only_its_own_package_imports_a_private_module(module):
    """``writer._plan`` is the writer's: the rest of dcp_tiered imports ``writer``."""
    package = module.split(".")[0]
    foreign = sorted(
        m for m in imports_of(MODULES[module]) if m in PRIVATE and m.split(".")[0] != package
    )
    assert foreign == [], f"{module} imports {foreign}, private to their package"


def test_the_manager_saves_through_the_lifecycle():
    """One save core: the manager keeps cadence, admission, the memory tier and events; its
    saves in flight, their uploads, failures and retention are the lifecycle's. So no module of
    the manager imports the upload queue or the retention passes, or calls DCP's save."""
    manager = {m: p for m, p in MODULES.items() if m.split(".")[0] == "manager"}
    assert {"manager.__init__", "manager._gate"} <= set(manager)
    assert _layer("manager._gate") == "entry" and _layer("lifecycle.saves") == "lifecycle"
    assert "manager._gate" in PRIVATE and "lifecycle" in imports_of(manager["manager.__init__"])
    for module, path in manager.items():
        below = imports_of(path) & {"tiers.uploads", "tiers.housekeeping"}
        assert below == set(), f"{module} imports {sorted(below)}: the lifecycle's"
        source = path.read_text()
        assert "async_save(" not in source and "dcp.save(" not in source, module


@pytest.mark.parametrize("module", sorted(MODULES))
def test_the_upload_queue_has_one_owner(module):
    """A root's uploads run on the queue its :class:`~dcp_tiered.tiers.root.Tiers` owns (the
    lifecycle's per root, or a lone writer's): nothing but ``tiers.root`` imports the queue,
    and the writer reaches the uploads only through the tiers it is given."""
    if module == "tiers.root":
        assert "tiers.uploads" in imports_of(MODULES[module])
        return
    assert "tiers.uploads" not in imports_of(MODULES[module]), f"{module} imports the queue"


def test_nobody_reaches_through_the_writer_for_its_tiers():
    """The owner holds the tiers, the writer is given them: a writer has no local tier or
    remote to hand out, no timings to pop and no step to keep local (a save's request and
    report travel with the save: SaveRequest, SaveReport), and no registry finds a queue."""
    from dcp_tiered.tiers import uploads
    from dcp_tiered.writer import TieredStorageWriter

    gone = ("local_tier", "remote_backend", "pop_timings", "keep_local")
    assert [n for n in gone if hasattr(TieredStorageWriter, n)] == []
    assert not hasattr(TieredStorageWriter, "last_stall_secs")
    assert [n for n in ("uploader_for", "acquire_uploader") if hasattr(uploads, n)] == []


def test_the_writers_plan_does_no_io():
    """``writer._plan`` decides (rank info, layouts, the checks before writing) and does no
    I/O: it imports neither the tiers nor the backends."""
    below = sorted(
        m for m in imports_of(PACKAGE / "writer" / "_plan.py") if _layer(m) in ("tiers", "backends")
    )
    assert below == []


def _name(module: str) -> str:
    """A package's ``__init__`` under the package's own name, as imports name it."""
    return module.removesuffix(".__init__")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (its strongly connected components with more than one
    module, or a module importing itself), by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


CLI = {_name(m): p for m, p in MODULES.items() if m.split(".")[0] == "cli"}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.split(".")[0] != "cli"))
def test_nothing_outside_the_cli_imports_it(module):
    cli = sorted(m for m in imports_of(MODULES[module]) if m.split(".")[0] == "cli")
    assert cli == [], f"{module} imports {cli}: the CLI is an entry point, nothing builds on it"


@pytest.mark.parametrize("module", sorted(m for m in CLI if m not in ("cli", "cli.__main__")))
def test_no_cli_module_imports_the_cli_package_back(module):
    """``cli/__init__`` imports the command modules (by name, after parsing); they import
    ``cli/_base`` and ``cli/_context``, never ``dcp_tiered.cli`` itself (the cycle it had)."""
    assert "cli" not in imports_of(CLI[module]), f"{module} imports dcp_tiered.cli"


def test_the_cli_package_has_no_import_cycle():
    graph = {m: {i for i in imports_of(p) if i in CLI} for m, p in CLI.items()}
    assert {"cli", "cli._base", "cli.steps", "cli.ops"} <= set(graph)
    assert "cli._base" in graph["cli"] and "cli._context" in graph["cli.steps"]
    assert _cycles(graph) == []


def test_the_package_has_no_import_cycle():
    """Every import counts, also one inside a function (the CLI's cycle was of those)."""
    names = {_name(m) for m in MODULES}
    graph = {_name(m): {i for i in imports_of(p) if i in names} for m, p in MODULES.items()}
    assert _cycles(graph) == []


def test_the_cycle_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}}) == [["a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# ------------------------------------------------------------ the remote tier and the backends

STORE_CLIENTS = {"fsspec", "s3fs", "botocore", "aiobotocore", "boto3"}


def third_party_imports(path: Path) -> set[str]:
    """Top-level names of the modules outside the package that ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
    return found - {"dcp_tiered"}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_only_the_backends_talk_to_a_store_client(module):
    """fsspec, s3fs and botocore stay behind backends/: errors are translated there once,
    and a tier speaks keys."""
    clients = sorted(third_party_imports(MODULES[module]) & STORE_CLIENTS)
    assert module.split(".")[0] == "backends" or clients == [], f"{module} imports {clients}"


def test_the_store_client_checker_sees_the_remote_backend():
    # the filesystems the remote backend uses are made in backends._clients (one per store)
    assert {"fsspec"} <= third_party_imports(PACKAGE / "backends" / "_clients.py")
    assert {"fsspec"} <= third_party_imports(PACKAGE / "backends" / "s3_checksums.py")
    assert not third_party_imports(PACKAGE / "tiers" / "remote.py") & STORE_CLIENTS


def test_the_backend_contract_depends_on_nothing_of_the_package():
    """``backends/base.py`` is the contract both backends implement: it names no backend, no
    tier and no policy."""
    assert imports_of(PACKAGE / "backends" / "base.py") == set()
    for backend in ("local.py", "remote.py"):
        assert "backends.base" in imports_of(PACKAGE / "backends" / backend), backend


def test_the_remote_tier_sits_below_its_promotion_and_its_pull():
    """``tiers.remote`` is what a committed remote step is (with its orphan sweep). How a step
    gets there (promotion, the upload queue) and how one is copied to the local tier (pull,
    which commits there) build on it; it imports neither, and never commits locally."""
    below = imports_of(PACKAGE / "tiers" / "remote.py") | imports_of(
        PACKAGE / "tiers" / "orphans.py"
    )
    assert below & {"tiers.promotion", "tiers.uploads", "tiers.pull", "tiers.commit"} == set()
    assert "tiers.remote" in imports_of(PACKAGE / "tiers" / "promotion.py")
    assert {"tiers.remote", "tiers.commit"} <= imports_of(PACKAGE / "tiers" / "pull.py")
    assert "tiers.promotion" not in imports_of(PACKAGE / "tiers" / "pull.py")


def test_the_prefix_strategy_is_spelled_as_a_string_only_at_the_edges():
    """``"hash"``/``"none"`` are what users and records spell; inside, a PrefixStrategy
    computes the keys. Only the config (the user's option) and policy/prefixes.py (the
    records) may compare the strings."""
    allowed = {"config", "policy.prefixes"}
    for module, path in MODULES.items():
        if module in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                names = [
                    c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)
                ]
                assert "hash" not in names, f"{module}:{node.lineno} compares 'hash'"
