"""Builds the API reference from the docstrings (pdoc) and checks it; run it as scripts/docs.

Fails (exit 1) when pdoc warns, when a docstring's cross reference (``:class:`X```, ``:meth:``,
``:func:``, ...) names nothing that exists from where it is written, or when a relative link
in the built HTML, README.md or docs/*.md points at a missing file or anchor. Runs in
.venv-lint, which sees the suite venv's packages (scripts/setup): pdoc imports the modules.
"""

from __future__ import annotations

import argparse
import builtins
import html.parser
import importlib
import inspect
import pkgutil
import re
import shutil
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import unquote, urlsplit

import pdoc
import pdoc.doc
import pdoc.docstrings
import pdoc.render

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's dcp_tiered, not an installed one

import dcp_tiered

ROLE = re.compile(r":(?:class|meth|func|attr|mod|exc|data|obj):`([^`]+)`")


def public_modules() -> list[str]:
    """dcp_tiered and its public first-level modules (pdoc walks the packages among them)."""
    found = pkgutil.iter_modules(dcp_tiered.__path__, "dcp_tiered.")
    return ["dcp_tiered", *sorted(m.name for m in found if m.name.split(".")[-1][0] != "_")]


def _scopes(module: ModuleType, cls: type | None) -> list[tuple[str, dict[str, Any]]]:
    """Where a name in a docstring is looked up, each with its dotted prefix: its class, its
    module, the package's public names (``TieredStorageWriter`` anywhere), builtins."""
    scopes = [(module.__name__, vars(module)), ("dcp_tiered", vars(dcp_tiered))]
    if cls is not None:
        members = {k: getattr(cls, k) for k in dir(cls)}
        scopes.insert(0, (f"{cls.__module__}.{cls.__qualname__}", members))
    return [*scopes, ("", vars(builtins))]


def _has(obj: Any, attr: str) -> bool:
    if hasattr(obj, attr):
        return True
    try:  # an instance attribute, set in __init__
        return inspect.isclass(obj) and f"self.{attr} " in inspect.getsource(obj)
    except (OSError, TypeError):
        return False


def _walk(obj: Any, parts: list[str]) -> bool:
    for part in parts:
        if not _has(obj, part):
            return False
        obj = getattr(obj, part, None)
    return True


def resolve(name: str, scopes: list[tuple[str, dict[str, Any]]]) -> str | None:
    """The dotted ``name``'s full path, looked up in ``scopes``, else as an import path."""
    first, *rest = name.split(".")
    for prefix, scope in scopes:
        if first in scope and _walk(scope[first], rest):
            obj = scope[first]
            if inspect.ismodule(obj):
                return ".".join([obj.__name__, *rest])
            if inspect.isclass(obj) or inspect.isfunction(obj):
                return ".".join([obj.__module__, obj.__qualname__, *rest])
            return f"{prefix}.{name}" if prefix else name
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return name if _walk(module, parts[i:]) else None
    return None


def _roles_as_code(convert: Any) -> Any:
    """pdoc reads Markdown and some reST, not Sphinx roles: show ``:class:`~a.B``` as `a.B`
    (its full path where the module resolves it), which pdoc links to its page."""
    by_file = {
        Path(m.__file__).resolve(): m
        for m in list(sys.modules.values())
        if getattr(m, "__file__", None) and m.__name__.startswith("dcp_tiered")
    }

    def code(m: re.Match[str], module: ModuleType | None) -> str:
        name = m.group(1).lstrip("~").removesuffix("()")
        full = resolve(name, _scopes(module, None)) if module is not None else None
        return f"`{full or name}`"

    def wrapped(docstring: str, docformat: str, source_file: Path | None) -> str:
        module = by_file.get(source_file.resolve()) if source_file else None
        docstring = ROLE.sub(lambda m: code(m, module), docstring)
        return convert(docstring, docformat, source_file)

    return wrapped


def broken_references(modules: list[pdoc.doc.Module]) -> list[str]:
    """Every role target that resolves neither where its docstring is written (its class,
    its module, the package, builtins) nor as a full import path."""
    problems = []
    seen: set[tuple[str, str]] = set()

    def visit(doc: pdoc.doc.Doc, cls: type | None) -> None:
        if doc.taken_from in seen or doc.taken_from[0] not in sys.modules:
            return
        seen.add(doc.taken_from)
        if isinstance(doc, pdoc.doc.Class):
            cls = doc.obj
        for target in ROLE.findall(doc.docstring):
            name = target.lstrip("~").removesuffix("()")
            if resolve(name, _scopes(sys.modules[doc.taken_from[0]], cls)) is None:
                problems.append(
                    f"{'.'.join(filter(None, doc.taken_from))}: {target!r} names nothing"
                )
        if isinstance(doc, pdoc.doc.Namespace):
            for member in doc.own_members:
                visit(member, cls)

    for mod in modules:
        visit(mod, None)
    return problems


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for key, value in attrs:
            if key in ("id", "name") and value:
                self.ids.add(value)
            if key == "href" and value:
                self.hrefs.append(value)


def _md_anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _md_links(path: Path) -> tuple[set[str], list[str]]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    ids = {_md_anchor(h) for h in re.findall(r"^#+\s+(.*)$", text, flags=re.MULTILINE)}
    return ids, re.findall(r"\]\(([^)\s]+)\)", text)


def broken_links(files: list[Path]) -> list[str]:
    """Relative links (and their #anchors) that point at nothing, in HTML and Markdown files."""
    anchors: dict[Path, set[str]] = {}
    links: dict[Path, list[str]] = {}
    for f in files:
        if f.suffix == ".md":
            anchors[f], links[f] = _md_links(f)
        else:
            parser = _Links()
            parser.feed(f.read_text())
            anchors[f], links[f] = parser.ids, parser.hrefs
    problems = []
    for f, hrefs in links.items():
        for href in hrefs:
            url = urlsplit(href)
            if url.scheme or url.netloc:
                continue  # outside links: not checked (CI has no network but PyPI)
            target = (f.parent / unquote(url.path)).resolve() if url.path else f
            if not target.exists():
                problems.append(f"{f.relative_to(REPO)}: {href} -> no such file")
            elif url.fragment and target in anchors and url.fragment not in anchors[target]:
                problems.append(f"{f.relative_to(REPO)}: {href} -> no such anchor")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "build" / "api"))
    ap.add_argument("--quiet", action="store_true", help="print only problems")
    args = ap.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    names = public_modules()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the frameworks' import-time notices, not ours
        for name in names:  # before _roles_as_code maps source files to modules
            importlib.import_module(name)
    pdoc.docstrings.convert = _roles_as_code(pdoc.docstrings.convert)  # type: ignore[assignment]
    pdoc.render.configure(docformat="google", search=True, show_source=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*names, output_directory=out)
    problems = [f"pdoc: {w.message}" for w in caught if Path(w.filename).parts[-2:-1] == ("pdoc",)]
    modules = [pdoc.doc.Module(sys.modules[m]) for m in sys.modules if m in _documented(out)]
    problems += broken_references(modules)
    pages = sorted(out.rglob("*.html"))
    docs = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
    problems += broken_links(pages + docs)
    for p in problems:
        print(f"scripts/docs: {p}", file=sys.stderr)
    if problems or not args.quiet:
        print(f"scripts/docs: {len(pages)} pages in {out}, {len(problems)} problem(s)")
    return 1 if problems else 0


def _documented(out: Path) -> set[str]:
    """The modules pdoc wrote a page for (dcp_tiered/tiers/local.html: dcp_tiered.tiers.local)."""
    return {
        ".".join(p.relative_to(out).with_suffix("").parts)
        for p in out.rglob("*.html")
        if p.name != "index.html"
    }


if __name__ == "__main__":
    sys.exit(main())
