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
import re
from collections.abc import Iterable, Iterator

from specdraft.doctor.source.reader import Found, SourceTree, instance_attributes

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
            names.add(s.name)
            for n in ast.walk(s):
                if (
                    isinstance(n, ast.Attribute)
                    and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name)
                    and n.value.id == "self"
                ):
                    names.add(n.attr)
        elif isinstance(s, ast.ClassDef):
            names.add(s.name)
        elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
            names.add(s.target.id)
        elif isinstance(s, ast.Assign):
            names |= {t.id for t in s.targets if isinstance(t, ast.Name)}
    return frozenset(names)


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
        self._texts: dict[str, str] | None = None
        self._headers: list[tuple[str, str, frozenset[str]]] | None = None
        self._attrs: dict[int, set[str] | None] = {}
        self._mentions: dict[str, list[str]] = {}
        # each asked once per scan: the same evidence sets, classes and bases recur for every name on an object
        self._candidates: dict[frozenset[str], list[Found]] = {}
        self._own: dict[int, frozenset[str]] = {}
        self._module_classes: dict[str, list[Found]] = {}
        self._bases: dict[int, list[int]] = {}

    @property
    def texts(self) -> dict[str, str]:
        """``{module: source text}`` of every module of the engine package."""
        if self._texts is None:
            self._texts = {}
            root = self.tree.root
            for path in sorted((root / self.engine).rglob("*.py")):
                parts = list(path.relative_to(root).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                self._texts[".".join(parts)] = path.read_text(encoding="utf-8", errors="replace")
        return self._texts

    @property
    def headers(self) -> list[tuple[str, str, frozenset[str]]]:
        """(module, class name, last names of its bases) of every ``class`` line of the package."""
        if self._headers is None:
            self._headers = []
            for module, text in self.texts.items():
                for m in _CLASS_HEADER.finditer(text):
                    bases = {b.strip().split("[")[0].split(".")[-1] for b in (m.group(2) or "").split(",")}
                    self._headers.append(
                        (module, m.group(1), frozenset(b for b in bases if b.isidentifier()))
                    )
        return self._headers

    def mentioning(self, word: str) -> list[str]:
        """Modules whose text contains ``word``."""
        if word not in self._mentions:
            self._mentions[word] = [m for m, text in self.texts.items() if word in text]
        return self._mentions[word]

    def _classes_of(self, module: str) -> list[Found]:
        """Every class defined in ``module`` (nested ones too)."""
        if module not in self._module_classes:
            parsed = self.tree.parse(module)
            path = self.tree.module_path(module) or self.tree.root
            self._module_classes[module] = [
                Found("class", module, path, node) for node in _classes(parsed.body if parsed else [])
            ]
        return self._module_classes[module]

    def _own_names(self, node: ast.ClassDef) -> frozenset[str]:
        if id(node) not in self._own:
            self._own[id(node)] = _own_names(node)
        return self._own[id(node)]

    def _base_ids(self, cls: Found) -> list[int]:
        """The engine classes ``cls`` derives from (its MRO without itself)."""
        if id(cls.node) not in self._bases:
            self._bases[id(cls.node)] = [id(b.node) for b in self.tree.mro(cls)[0][1:]]
        return self._bases[id(cls.node)]

    def attrs(self, cls: Found) -> set[str] | None:
        """Names instances of ``cls`` have, engine bases followed (None: ``__getattr__`` makes them dynamic)."""
        key = id(cls.node)
        if key not in self._attrs:
            self._attrs[key] = instance_attributes(self.tree, cls)
        return self._attrs[key]

    def candidates(self, evidence: frozenset[str]) -> list[Found]:
        """Classes whose instances have every name in ``evidence`` and that no other such class derives
        from (bases shared by several model classes are not what a caller holds), sorted by module and name."""
        if not evidence:
            return []
        if evidence not in self._candidates:
            self._candidates[evidence] = self._find(evidence)
        return list(self._candidates[evidence])

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
