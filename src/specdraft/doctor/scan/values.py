"""``doctor --scan``: the values the scanner tracks, and what engine objects they stand for.

A :class:`Val` is what the scanner knows about an expression of the scanned package: an engine module,
class, function or method (found in the engine source by :class:`~specdraft.doctor.source.reader.SourceTree`),
an instance of engine classes, an engine object of unknown type (``opaque``: identified by the access
path that produced it, e.g. ``vllm.v1.worker.gpu_model_runner:GPUModelRunner.model.model``), a class,
instance, function or module of the scanned package, something outside both (``ext``: torch, stdlib),
or nothing known. :class:`LocalClass` / :class:`LocalFunc` hold what the walk learns about the package's
classes and functions, :class:`Scope` the names visible in a block, :class:`Site` one reference into the
engine. The helpers look things up in the engine source: star-import aware lookups, annotations turned
into classes or containers of them, the value of an attribute and of a call.
"""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from specdraft.doctor.source.reader import (
    Found,
    SourceTree,
    decorators,
    dotted_name,
    instance_attributes,
    self_attr,
    top_statements,
)

__all__ = [
    "CONTAINERS",
    "UNKNOWN",
    "LocalClass",
    "LocalFunc",
    "Scope",
    "Site",
    "Val",
    "annotation_classes",
    "call_result",
    "container_elements",
    "engine_attr",
    "engine_lookup",
    "engine_resolve",
    "homogeneous",
    "is_none",
    "symbol_of",
    "unquoted",
    "val_of",
]


@dataclass(frozen=True)
class Val:
    """What is known of a value.

    ``kind``: ``emod``/``eclass``/``efunc``/``emeth`` (engine symbols, in ``finds``), ``einst`` (an
    instance of one of ``finds``), ``econt`` (a list, iterator, ... of them), ``opaque`` (an engine object
    of unknown type, ``oid`` its access path), ``lclass``/``linst``/``lfunc``/``lmod`` (the scanned
    package's; ``ref``), ``ext`` (outside package and engine; ``oid`` its dotted name), ``unknown``.
    """

    kind: str
    finds: tuple[Found, ...] = ()
    oid: str = ""
    ref: Any = None
    via_class: bool = False  # a method taken from its class (``Cls.meth(obj, ...)``: ``self`` is passed)
    partial: bool = False  # annotated with a union: the value may also be something outside the engine
    #: an instance of every class of ``finds`` at once (a subclass of each: a name on any is there)
    combined: bool = False

    @property
    def engine(self) -> bool:
        """Whether this stands for an engine object."""
        return self.kind in ("emod", "eclass", "efunc", "emeth", "einst", "econt", "opaque")

    def describe(self) -> str:
        """A short name for messages."""
        if self.kind == "opaque":
            return self.oid
        if self.kind == "econt":
            return "[" + " | ".join(symbol_of(f) for f in self.finds) + "]"
        if self.finds:
            return " | ".join(symbol_of(f) for f in self.finds)
        return self.oid or self.kind


UNKNOWN = Val("unknown")


@dataclass(eq=False)
class LocalClass:
    """A class of the scanned package: its self-attribute values and the engine classes it extends."""

    module: str
    node: ast.ClassDef
    qualname: str
    bases: list[Val] = field(default_factory=list)
    plugged: list[Found] = field(default_factory=list)  # engine classes it is mixed into at run time
    attrs: dict[str, Val] = field(default_factory=dict)
    stored: set[str] = field(default_factory=set)  # every ``self.<name>`` the package assigns

    def engine_bases(self) -> tuple[Found, ...]:
        """Engine classes whose members instances of this class have (bases, classes it is plugged into)."""
        out: list[Found] = list(self.plugged)
        for b in self.bases:
            if b.kind == "eclass":
                out.extend(b.finds)
            elif b.kind == "lclass":
                out.extend(b.ref.engine_bases())
        return tuple(out)


@dataclass(eq=False)
class LocalFunc:
    """A function of the scanned package: values its parameters receive and what it returns."""

    module: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    cls: LocalClass | None = None
    params: dict[str, Val] = field(default_factory=dict)
    returns: Val = UNKNOWN


@dataclass
class Site:
    """One reference from the scanned package into the engine.

    ``kind``: ``import`` (``name`` is ``module:attr`` or a module), ``attr`` (``name`` read on ``recv``),
    ``store`` (``name`` assigned on ``recv``), ``call`` (``recv`` is the callee; ``n_pos``/``keywords``
    what is passed; ``splat``/``dsplat`` for ``*args``/``**kwargs``).
    """

    kind: str
    path: str
    line: int
    text: str
    recv: Val | None = None
    name: str = ""
    hit: Found | None = None
    why: str = ""
    n_pos: int = 0
    keywords: tuple[str, ...] = ()
    splat: bool = False
    dsplat: bool = False
    guarded: bool = False
    tolerant: bool = False  # getattr(x, "name", default) / hasattr: a missing name is handled


@dataclass
class Scope:
    """Names visible in a block: its own, then the enclosing function scopes, then the module's."""

    module: str
    vars: dict[str, Val] = field(default_factory=dict)
    parent: Scope | None = None
    cls: LocalClass | None = None  # the class whose body or method this is (``super()``)
    class_body: bool = False
    guarded: bool = False  # inside ``try: ... except ImportError``
    guards: frozenset[tuple[str, str]] = frozenset()  # (expression, name) checked by ``hasattr`` around here
    attr_errors: bool = False  # inside ``try: ... except AttributeError``

    def child(self, class_body: bool = False, cls: LocalClass | None = None) -> Scope:
        """A nested scope."""
        return dataclasses.replace(self, vars={}, parent=self, cls=cls or self.cls, class_body=class_body)

    def variant(self, **changes: object) -> Scope:
        """The same names (shared), other flags: for a guarded block."""
        return dataclasses.replace(self, **changes)

    def tolerates(self, node: ast.AST, attr: str) -> bool:
        """Whether reading ``attr`` at ``node`` is feature detection: under ``if hasattr(obj, "attr")`` or in a
        ``try`` that catches ``AttributeError``."""
        obj = getattr(node, "value", None)
        return self.attr_errors or (obj is not None and (ast.unparse(obj), attr) in self.guards)


def symbol_of(f: Found) -> str:
    """``module:Qual.name`` of a found symbol (the module alone for a module)."""
    if f.kind == "module":
        return f.module
    name = getattr(f.node, "name", None) or _target_name(f.node)
    return f"{f.module}:{f.owner.node.name}.{name}" if f.owner is not None else f"{f.module}:{name}"


def _target_name(node: Any) -> str:
    """The name an (annotated) assignment binds, ``?`` when it binds no plain name."""
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    if isinstance(node, ast.Assign):
        return next((t.id for t in node.targets if isinstance(t, ast.Name)), "?")
    return "?"


# ---------------------------------------------------------------------------------------------
# lookups in the engine source (star imports followed)
# ---------------------------------------------------------------------------------------------
def _exported(tree: SourceTree, module: str, name: str) -> bool:
    """Whether ``from module import *`` binds ``name`` (its ``__all__``, else every public name)."""
    parsed = tree.parse(module)
    for s in top_statements(parsed.body if parsed else []):
        if isinstance(s, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in s.targets
        ):
            if isinstance(s.value, (ast.List, ast.Tuple)):
                return any(isinstance(e, ast.Constant) and e.value == name for e in s.value.elts)
    return not name.startswith("_")


def engine_lookup(tree: SourceTree, module: str, name: str, depth: int = 0) -> Found | None:
    """Where ``name`` of engine ``module`` is defined: :meth:`SourceTree.lookup`, plus star imports."""
    hit = tree.lookup(module, name)
    if hit is not None or depth > 10:
        return hit
    parsed = tree.parse(module)
    for s in top_statements(parsed.body if parsed else []):
        if not isinstance(s, ast.ImportFrom):
            continue
        src = tree.absolute(module, s.level, s.module)
        for a in s.names:
            if (a.name == "*" and _exported(tree, src, name)) or (a.asname or a.name) == name:
                hit = engine_lookup(tree, src, name if a.name == "*" else a.name, depth + 1)
                if hit is not None:
                    return hit
    for s in top_statements(parsed.body if parsed else []):  # a module-level variable
        if (isinstance(s, ast.Assign) and any(_assigned(t, name) for t in s.targets)) or (
            isinstance(s, ast.AnnAssign) and _assigned(s.target, name)
        ):
            return Found("attr", module, tree.module_path(module) or tree.root, s)
    return None


def _assigned(target: ast.AST, name: str) -> bool:
    """Whether an assignment target binds ``name`` (tuples unpacked)."""
    if isinstance(target, ast.Name):
        return target.id == name
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(_assigned(e, name) for e in target.elts)
    return False


def engine_resolve(tree: SourceTree, module: str, expr: ast.AST | str) -> Found | None:
    """A dotted expression (``a.b.C``) written in engine ``module``, resolved like :meth:`SourceTree.resolve_expr`."""
    dotted = expr if isinstance(expr, str) else dotted_name(expr)
    if not dotted:
        return None
    head, *rest = dotted.split(".")
    return tree.descend(engine_lookup(tree, module, head), rest, lambda m, n: engine_lookup(tree, m, n))


def annotation_classes(
    tree: SourceTree, module: str, ann: ast.AST | None, owner: Found | None
) -> list[Found]:
    """Engine classes an annotation names: ``X``, ``"X"``, ``X | None``, ``Optional[X]``, ``Self``."""
    ann = unquoted(ann)
    if ann is None:
        return []
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        return _union(tree, module, [ann.left, ann.right], owner)
    if isinstance(ann, ast.Subscript):
        base = dotted_name(ann.value).split(".")[-1]
        if base in ("Optional", "Union"):
            elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
            return _union(tree, module, elts, owner)
        if base == "Annotated" and isinstance(ann.slice, ast.Tuple):
            return annotation_classes(tree, module, ann.slice.elts[0], owner)
        return []
    name = dotted_name(ann)
    if name.split(".")[-1] == "Self" and owner is not None:
        return [owner]
    found = engine_resolve(tree, module, ann) if name else None
    if found is None and owner is not None and isinstance(ann, ast.Name):
        found = _resolve_in_class(tree, owner, ann)
    return [found] if found is not None and found.kind == "class" else []


# ---------------------------------------------------------------------------------------------
# values of engine expressions
# ---------------------------------------------------------------------------------------------
def _union(tree: SourceTree, module: str, members: list[ast.expr], owner: Found | None) -> list[Found]:
    """The classes of a union annotation; none when a member (other than ``None``) is not an engine class."""
    out: list[Found] = []
    for m in members:
        if is_none(m):
            continue
        found = annotation_classes(tree, module, m, owner)
        if not found:
            return []
        out += found
    return out


def val_of(tree: SourceTree, found: Found, oid: str = "") -> Val:
    """The value a found engine symbol stands for (a class attribute: its annotated type, or opaque)."""
    if found.kind == "module":
        return Val("emod", (found,))
    if found.kind == "class":
        return Val("eclass", (found,))
    if found.kind == "function":
        if found.owner is not None and decorators(found.node) & {"property", "cached_property"}:
            return _typed(tree, found.module, found.node.returns, found.owner, oid or symbol_of(found))
        return Val("emeth" if found.owner is not None else "efunc", (found,))
    ann = found.node.annotation if isinstance(found.node, ast.AnnAssign) else None
    return _typed(tree, found.module, ann, found.owner, oid or symbol_of(found))


def _typed(tree: SourceTree, module: str, ann: ast.AST | None, owner: Found | None, oid: str) -> Val:
    """An instance of the classes ``ann`` names, a container of them (``list[X]``, ``AsyncGenerator[X, None]``),
    else an opaque engine object called ``oid``."""
    classes = annotation_classes(tree, module, ann, owner)
    if classes:
        return Val("einst", tuple(classes))
    elements = container_elements(tree, module, ann, owner)
    return Val("econt", tuple(elements)) if elements else Val("opaque", oid=oid)


def container_elements(
    tree: SourceTree, module: str, ann: ast.AST | None, owner: Found | None
) -> list[Found]:
    """The engine classes of the elements of a container annotation (``list[X]``, ``Iterator[X]``,
    ``AsyncGenerator[X, None]``, ``tuple[X, ...]``, optional ones too); none for anything else."""
    ann = unquoted(ann)
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        sides = [a for a in (ann.left, ann.right) if not is_none(a)]
        return container_elements(tree, module, sides[0], owner) if len(sides) == 1 else []
    if not isinstance(ann, ast.Subscript):
        return []
    base = dotted_name(ann.value).split(".")[-1]
    args = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
    if base == "Optional":
        return container_elements(tree, module, args[0], owner)
    return annotation_classes(tree, module, args[0], owner) if homogeneous(base, args) else []


def unquoted(ann: ast.AST | None) -> ast.AST | None:
    """A string annotation (``"X"``) parsed (None when it does not parse); any other one as it is."""
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            return ast.parse(ann.value, mode="eval").body
        except SyntaxError:
            return None
    return ann


def is_none(node: ast.AST) -> bool:
    """Whether an annotation is ``None``."""
    return (isinstance(node, ast.Constant) and node.value is None) or dotted_name(node) == "None"


def homogeneous(base: str, args: list[ast.expr]) -> bool:
    """Whether ``base[args]`` is a container of ``args[0]`` (:data:`CONTAINERS`; a tuple only as ``tuple[X, ...]``)."""
    ellipsis = len(args) == 2 and isinstance(args[1], ast.Constant) and args[1].value is ...
    return base in CONTAINERS and (base not in ("tuple", "Tuple") or ellipsis)


#: generic containers whose first type argument is what iterating or indexing them gives
CONTAINERS = {
    "list", "List", "Sequence", "MutableSequence", "Iterable", "Iterator", "AsyncIterable", "AsyncIterator",
    "Generator", "AsyncGenerator", "set", "Set", "frozenset", "FrozenSet", "Collection", "deque", "tuple", "Tuple",
}  # fmt: skip


def _instance_attr_val(tree: SourceTree, cls: Found, attr: str) -> Val:
    """The value of ``instance.<attr>`` set in the methods of ``cls`` or, when it sets none, of its nearest
    engine base that does: what every assignment there gives (a constructor call, an annotation, an
    annotated parameter; ``None`` aside) when all agree it is engine instances or containers of them,
    else an opaque engine object."""
    vals: list[Val] = []
    for c in tree.mro(cls)[0]:
        if vals:
            break  # the most derived class that assigns the attribute decides its type
        for fn in (s for s in c.node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))):
            a = fn.args
            params = {p.arg: p.annotation for p in a.posonlyargs + a.args + a.kwonlyargs if p.annotation}
            for node in ast.walk(fn):
                v = None
                if isinstance(node, ast.AnnAssign) and self_attr(node.target) == attr:
                    v = _typed(tree, c.module, node.annotation, c, "")
                elif isinstance(node, ast.Assign) and any(self_attr(t) == attr for t in node.targets):
                    v = _assigned_val(tree, c, node.value, params)
                vals += [v] if v is not None else []
    if vals and len({v.kind for v in vals}) == 1 and vals[0].kind != "opaque":
        return _merge(vals)
    return Val("opaque", oid=f"{symbol_of(cls)}.{attr}")


def _assigned_val(tree: SourceTree, cls: Found, value: ast.expr, params: dict[str, ast.expr]) -> Val | None:
    """What ``self.x = value`` in a method of ``cls`` gives (None for ``None``; opaque when unknown)."""
    if isinstance(value, ast.Constant) and value.value is None:
        return None
    if isinstance(value, ast.Name) and value.id in params:
        return _typed(tree, cls.module, params[value.id], cls, "")
    made = _resolve_in_class(tree, cls, value.func) if isinstance(value, ast.Call) else None
    return Val("einst", (made,)) if made is not None and made.kind == "class" else Val("opaque")


def _resolve_in_class(tree: SourceTree, cls: Found, expr: ast.expr) -> Found | None:
    """``expr`` written in a method of ``cls``: module-level names, then imports inside the class's methods."""
    found = engine_resolve(tree, cls.module, expr)
    if found is not None or not isinstance(expr, ast.Name):
        return found
    for node in ast.walk(cls.node):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                if (a.asname or a.name) == expr.id:
                    return engine_lookup(tree, tree.absolute(cls.module, node.level, node.module), a.name)
    return None


def engine_attr(tree: SourceTree, recv: Val, attr: str) -> Val:
    """The value of ``recv.<attr>`` for an engine value (``UNKNOWN`` when missing: the checker reports it)."""
    if recv.kind == "opaque":
        return Val("opaque", oid=f"{recv.oid}.{attr}")
    if recv.kind == "econt":
        return UNKNOWN  # a list's, an iterator's methods
    if recv.kind == "emod":
        hit = engine_lookup(tree, recv.finds[0].module, attr)
        return val_of(tree, hit) if hit is not None else UNKNOWN
    if recv.kind == "eclass":
        hit = tree.member(recv.finds[0], attr)
        v = val_of(tree, hit) if hit is not None else UNKNOWN
        unbound = v.kind == "emeth" and not decorators(hit.node) & {"classmethod", "staticmethod"}
        return Val("emeth", v.finds, via_class=True) if unbound else v
    if recv.kind == "einst":
        vals = []
        for cls in recv.finds:
            hit = tree.member(cls, attr)
            if hit is not None:
                vals.append(val_of(tree, hit, f"{symbol_of(cls)}.{attr}"))
            elif attr in (instance_attributes(tree, cls) or set()):
                vals.append(_instance_attr_val(tree, cls, attr))
        return _merge(vals) if vals else Val("opaque", oid=f"{recv.describe()}.{attr}")
    return UNKNOWN


def _merge(vals: list[Val]) -> Val:
    """One value for several candidates: the union when all are of one kind, else the first."""
    if not vals:
        return UNKNOWN
    if len({v.kind for v in vals}) == 1 and vals[0].kind in ("einst", "econt", "emeth", "eclass", "efunc"):
        finds: list[Found] = []
        for v in vals:
            finds.extend(f for f in v.finds if all(f.node is not g.node for g in finds))
        return Val(vals[0].kind, tuple(finds), via_class=vals[0].via_class)
    return vals[0]


def call_result(tree: SourceTree, callee: Val, oid: str) -> Val:
    """What calling an engine value returns: an instance for a class, the annotated return type of a
    function or method, else an opaque engine object called ``oid``."""
    if callee.kind == "eclass":
        return Val("einst", callee.finds)
    if callee.kind in ("efunc", "emeth"):
        return _merge([_typed(tree, f.module, f.node.returns, f.owner, oid) for f in callee.finds])
    return Val("opaque", oid=oid) if callee.engine else UNKNOWN
