"""``doctor --scan``: what an engine object of unknown type can be, from how the package uses it.

An object the package gets from the engine without a type the source states (``runner.model.model``, a
model class chosen at run time) is known only by the names the package reads on it. :class:`ClassIndex`
lists every class of the engine package with the names its instances have (methods, class and
``self`` attributes, base classes in the engine followed); :meth:`ClassIndex.candidates` returns the
classes that have all the names of a given set. The scanner asks it, for each name read on such an
object, which classes have all the *other* names read there, and whether they have this one: a method
none of them (or most of them) has any more was renamed or removed.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from specdraft.doctor.source.reader import Found, SourceTree, instance_attributes, self_stores

__all__ = ["ClassIndex"]


def _classes(body: Iterable[ast.stmt]) -> Iterator[ast.ClassDef]:
    """Class definitions among statements, nested classes and ``if``/``try`` blocks included."""
    for s in body:
        if isinstance(s, ast.ClassDef):
            yield s
            yield from _classes(s.body)
        elif isinstance(s, (ast.If, ast.Try)):
            yield from _classes(s.body)
            yield from _classes(s.orelse)
            yield from _classes(getattr(s, "finalbody", []))


def _own_names(node: ast.ClassDef) -> frozenset[str]:
    """Names a class body defines itself: methods, class attributes, ``self.<name>`` assigned in methods."""
    names: set[str] = set()
    for s in node.body:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names |= {s.name, *self_stores(s)}
        elif isinstance(s, ast.ClassDef):
            names.add(s.name)
        elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
            names.add(s.target.id)
        elif isinstance(s, ast.Assign):
            names |= {t.id for t in s.targets if isinstance(t, ast.Name)}
    return frozenset(names)


def _memo(table: dict[Any, Any], key: Any, compute: Callable[[], Any]) -> Any:
    """``table[key]``, computed once."""
    if key not in table:
        table[key] = compute()
    return table[key]


_CLASS_HEADER = re.compile(r"^[ \t]*class[ \t]+(\w+)[ \t]*(?:\(([^)]*)\))?[ \t]*:", re.M)


class ClassIndex:
    """The classes of an engine package and the names their instances have, read on demand.

    Finding the classes that have every name of a set reads few files: only those mentioning the
    rarest name are parsed for classes defining it, and their subclasses are found through the class
    headers of every file (a regular expression, no parse).
    """

    def __init__(self, tree: SourceTree, engine: str):
        """The classes of package ``engine`` under ``tree``'s root."""
        self.tree, self.engine = tree, engine
        self._attrs: dict[int, set[str] | None] = {}
        self._mentions: dict[str, list[str]] = {}
        # each asked once per scan: the same evidence sets, classes and bases recur for every name on an object
        self._candidates: dict[frozenset[str], list[Found]] = {}
        self._own: dict[int, frozenset[str]] = {}
        self._module_classes: dict[str, list[Found]] = {}
        self._bases: dict[int, list[int]] = {}

    @functools.cached_property
    def texts(self) -> dict[str, str]:
        """``{module: source text}`` of every module of the engine package."""
        texts, root = {}, self.tree.root
        for path in sorted((root / self.engine).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            texts[".".join(parts)] = path.read_text(encoding="utf-8", errors="replace")
        return texts

    @functools.cached_property
    def headers(self) -> list[tuple[str, str, frozenset[str]]]:
        """(module, class name, last names of its bases) of every ``class`` line of the package."""
        headers = []
        for module, text in self.texts.items():
            for m in _CLASS_HEADER.finditer(text):
                bases = {b.strip().split("[")[0].split(".")[-1] for b in (m.group(2) or "").split(",")}
                headers.append((module, m.group(1), frozenset(b for b in bases if b.isidentifier())))
        return headers

    def mentioning(self, word: str) -> list[str]:
        """Modules whose text contains ``word``."""
        return _memo(self._mentions, word, lambda: [m for m, text in self.texts.items() if word in text])

    def _classes_of(self, module: str) -> list[Found]:
        """Every class defined in ``module`` (nested ones too)."""
        if module not in self._module_classes:
            parsed = self.tree.parse(module)
            path = self.tree.module_path(module) or self.tree.root
            classes = _classes(parsed.body if parsed else [])
            self._module_classes[module] = [Found("class", module, path, node) for node in classes]
        return self._module_classes[module]

    def _own_names(self, node: ast.ClassDef) -> frozenset[str]:
        return _memo(self._own, id(node), lambda: _own_names(node))

    def _base_ids(self, cls: Found) -> list[int]:
        """The engine classes ``cls`` derives from (its MRO without itself)."""
        return _memo(self._bases, id(cls.node), lambda: [id(b.node) for b in self.tree.mro(cls)[0][1:]])

    def attrs(self, cls: Found) -> set[str] | None:
        """Names instances of ``cls`` have, engine bases followed (None: ``__getattr__`` makes them dynamic)."""
        return _memo(self._attrs, id(cls.node), lambda: instance_attributes(self.tree, cls))

    def candidates(self, evidence: frozenset[str]) -> list[Found]:
        """Classes whose instances have every name in ``evidence`` and that no other such class derives
        from (bases shared by several model classes are not what a caller holds), sorted by module and name."""
        return list(_memo(self._candidates, evidence, lambda: self._find(evidence))) if evidence else []

    def _find(self, evidence: frozenset[str]) -> list[Found]:
        rare = min(sorted(evidence), key=lambda w: len(self.mentioning(w)))
        pool: dict[int, Found] = {}
        for module in self.mentioning(rare):
            for f in self._classes_of(module):
                if rare in self._own_names(f.node):
                    pool[id(f.node)] = f
        names = {f.node.name for f in pool.values()}
        grew = True
        while grew:  # subclasses inherit what their bases define
            grew = False
            for module, name, bases in self.headers:
                if name not in names and bases & names:
                    for f in self._classes_of(module):
                        if f.node.name == name and id(f.node) not in pool:
                            pool[id(f.node)] = f
                    names.add(name)
                    grew = True
        out = [f for f in pool.values() if evidence <= (self.attrs(f) or set())]
        bases = {b for f in out for b in self._base_ids(f)}
        leaves = [f for f in out if id(f.node) not in bases]  # a base of another candidate is not one itself
        return sorted(leaves, key=lambda f: (f.module, f.node.name))
