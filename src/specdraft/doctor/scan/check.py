"""``doctor --scan``: bind every recorded reference against the engine source and judge it.

Each :class:`~specdraft.doctor.scan.values.Site` becomes a :class:`Finding`: ``ok``, ``break`` (a missing
module, name, method or attribute; a call the engine's signature refuses: too many positional
arguments, a keyword it does not accept, a required parameter or field not passed), ``warning`` (a
guarded import, a name missing on some of the classes a value can be, an attribute assigned that the
engine no longer has) or ``unchecked`` (the receiver's type is unknown and its use does not single out
engine classes, a signature built outside the engine source, a name that may come from a base class
outside it). Nothing is passed silently: every site is counted in one of these.

Receivers of unknown type are judged by :class:`~specdraft.doctor.scan.struct.ClassIndex`: with at least
:data:`MIN_EVIDENCE` other names read on the same object, the engine classes having them all are its
candidates; a name most candidates lack (all, or more than half) is a break, one some lack a warning.
"""

from __future__ import annotations

import ast
import difflib
from collections import Counter, defaultdict
from dataclasses import dataclass

from specdraft.doctor.scan.source import tilde
from specdraft.doctor.scan.struct import ClassIndex
from specdraft.doctor.scan.values import Site, engine_lookup, symbol_of
from specdraft.doctor.source.reader import Found, SigInfo, SourceTree, signature, top_statements

__all__ = ["BREAK_EVIDENCE", "MIN_EVIDENCE", "Finding", "bind_messages", "check_sites", "similar_names"]

#: names read on an object of unknown type (besides the one checked) needed to infer its classes
MIN_EVIDENCE = 3
#: ... and needed to call a name most of those classes lack a break (with fewer: a warning)
BREAK_EVIDENCE = 4
_TRIVIAL_BASES = {"object", "Generic", "Protocol", "ABC", "ABCMeta"}


@dataclass
class Finding:
    """The verdict on one site."""

    severity: str  # ok, break, warning, unchecked
    site: Site
    message: str
    symbol: str = ""
    installed: str = ""
    location: str = ""


def bind_messages(
    sig: SigInfo, n_pos: int, keywords: tuple[str, ...], splat: bool, dsplat: bool
) -> list[str]:
    """Every way a call passing ``n_pos`` positional arguments and ``keywords`` fails against ``sig``
    (``splat``/``dsplat``: it passes ``*args``/``**kwargs``, see :meth:`SigInfo.failures`)."""
    n, twice, unknown, _, missing = sig.failures(n_pos, keywords, splat, dsplat)
    msgs = [] if n is None else [f"takes at most {n} positional argument(s), the call passes {n_pos}"]
    msgs += [f"keyword {k!r} fills a positional slot the call already fills" for k in twice]
    if unknown:
        msgs.append(f"does not accept keyword(s) {unknown}")
    if missing:
        msgs.append(f"required parameter(s)/field(s) not passed: {missing}")
    return msgs


def _sig_text(sig: SigInfo) -> str:
    """A signature and what built it, for the report."""
    return f"{sig.text}  [{sig.origin}]"


class Checker:
    """Judges sites against one engine source tree."""

    def __init__(self, tree: SourceTree, index: ClassIndex):
        """Judge against ``tree``; ``index`` finds the classes of receivers of unknown type."""
        self.tree, self.index = tree, index
        self.reads: dict[str, set[str]] = defaultdict(set)
        self.stores: dict[str, set[str]] = defaultdict(set)
        self.inferred: dict[tuple[str, str], list[Found]] = {}
        self._broken: dict[str, set[str]] = {}

    def run(self, sites: list[Site]) -> list[Finding]:
        """A finding for every site (attribute reads first: calls on unknown receivers use them)."""
        for s in sites:
            if s.recv is not None and s.recv.kind == "opaque" and s.kind in ("attr", "store"):
                (self.reads if s.kind == "attr" else self.stores)[s.recv.oid].add(s.name)
        order = {"import": 0, "attr": 1, "store": 2, "call": 3}
        out: list[Finding] = []
        listed: set[tuple[str, int, str]] = set()
        for s in sorted(sites, key=lambda s: order[s.kind]):
            f = self.judge(s)
            if s.kind == "attr" and f.severity != "ok" and s.recv is not None:
                listed.add((s.path, s.line, f"{s.recv.describe()}.{s.name}"))
            # a call on what an unchecked attribute read of the same line gives: that read is listed already
            listed_already = s.recv is not None and (s.path, s.line, s.recv.oid) in listed
            if not (s.kind == "call" and f.severity == "unchecked" and listed_already):
                out.append(f)
        return out

    def judge(self, s: Site) -> Finding:
        """The verdict on one site (a missing name the package checks for itself is fine)."""
        if s.kind == "import":
            f = self.judge_import(s)
        elif s.recv is not None and s.recv.kind == "opaque":
            f = self.judge_opaque(s)
        elif s.kind in ("attr", "store"):
            f = self.judge_attr(s)
        else:
            f = self.judge_call(s)
        if s.tolerant and f.severity in ("break", "warning"):
            f.severity = "ok"
            f.message += " -- handled by the package (hasattr, getattr default or except AttributeError)"
        return f

    # -----------------------------------------------------------------------------------------
    def judge_import(self, s: Site) -> Finding:
        """An import: the module and name exist (a guarded import that fails is a warning)."""
        module, _, name = s.name.partition(":")
        sev = "warning" if s.guarded else "break"
        if s.hit is not None:
            return Finding("ok", s, "resolves", symbol_of(s.hit), location=tilde(s.hit.location))
        if self.tree.module_path(module) is None:
            return Finding(sev, s, f"module {module} not found in the engine source", module)
        if _module_getattr(self.tree, module):
            why = f"{module} builds names at run time (__getattr__): {name!r} not checked"
            return Finding("unchecked", s, why)
        return Finding(sev, s, f"{module} has no {name!r} (renamed or removed?){_hint(name, _module_names(self.tree, module))}",
                       f"{module}:{name}", location=tilde(self.tree.module_path(module) or ""))  # fmt: skip

    def judge_attr(self, s: Site) -> Finding:
        """An attribute read or assigned on an engine module, class or instance of known classes."""
        recv, name = s.recv, s.name
        assert recv is not None
        if name.startswith("__") or recv.kind in ("efunc", "emeth"):
            return Finding("ok", s, "not checked (dunder or function attribute)")
        if recv.kind == "emod":
            module = recv.finds[0].module
            if engine_lookup(self.tree, module, name) is not None:
                return Finding("ok", s, "resolves")
            if _module_getattr(self.tree, module):
                return Finding("unchecked", s, f"{module} builds names at run time (__getattr__)")
            names = _module_names(self.tree, module)
            return self._missing(s, f"module {module} has no {name!r}", names, module)
        have, lack, unsure = [], [], []
        for cls in recv.finds:
            state = self._has(cls, name)
            (have if state is True else lack if state is False else unsure).append(cls)
        if have and (not lack or recv.combined):  # a subclass of several: a name on any of them is there
            return Finding("ok", s, "resolves")
        if recv.partial and not have:
            return Finding("unchecked", s, f"{name!r} is not on {_names(lack)}; the value may also be of a type "
                           "outside the engine (a union annotation)")  # fmt: skip
        if have:
            return Finding("warning", s, f"{name!r} exists on {_names(have)} but not on {_names(lack)}",
                           symbol_of(lack[0]), location=tilde(lack[0].location))  # fmt: skip
        if unsure:
            why = ", ".join(f"{c.node.name} ({_why_open(self.tree, c)})" for c in unsure)
            why = f"{name!r} is not in the engine source of {why}: it may come from there"
            return Finding("unchecked", s, why)
        names = set().union(*(self.index.attrs(c) or set() for c in lack))
        what = f"{_names(lack)} has no attribute {name!r}"
        return self._missing(s, what, names, symbol_of(lack[0]), lack[0])

    def _missing(self, s: Site, what: str, names: set[str], symbol: str, cls: Found | None = None) -> Finding:
        """A name that is not there: a break when read, a warning when assigned (nothing reads it)."""
        loc, hint = tilde(cls.location) if cls is not None else "", _hint(s.name, names)
        if s.kind == "store":
            return Finding("warning", s, f"{what}: the assignment no longer configures anything (renamed?)"
                           f"{hint}", symbol, location=loc)  # fmt: skip
        return Finding("break", s, f"{what} (renamed or removed?){hint}", symbol, location=loc)

    def _has(self, cls: Found, name: str) -> bool | None:
        """Whether instances of ``cls`` have ``name``; None when the source cannot tell."""
        attrs = self.index.attrs(cls)
        if attrs is None:
            return None
        if name in attrs or self.tree.member(cls, name) is not None:
            return True
        return None if _external(self.tree, cls) or _is_protocol(self.tree, cls) else False

    # -----------------------------------------------------------------------------------------
    def judge_call(self, s: Site) -> Finding:
        """A call of an engine class, function or method (or an instance: its ``__call__``)."""
        recv = s.recv
        assert recv is not None
        targets = list(recv.finds)
        if recv.kind == "einst":
            targets = [m for m in (self.tree.member(c, "__call__") for c in recv.finds) if m is not None]
            if not targets:
                why = f"calls an instance of {_names(recv.finds)}: no __call__ in its source"
                return Finding("unchecked", s, why)
        return self._bind(s, targets, s.n_pos - (1 if recv.via_class else 0))

    def _bind(self, s: Site, targets: list[Found], n_pos: int) -> Finding:
        """Bind the call at ``s`` to each candidate callee: a break when it fails on most of them."""
        fails, oks, unknown = [], [], []
        for t in targets:
            sig = signature(self.tree, t)
            if sig is None:
                unknown.append(t)
                continue
            msgs = bind_messages(sig, n_pos, s.keywords, s.splat, s.dsplat)
            (fails if msgs else oks).append((t, sig, msgs))
        if not fails:
            if oks:
                t, sig, _ = oks[0]
                return Finding("ok", s, "binds", symbol_of(t), _sig_text(sig), tilde(sig.location))
            why = "; ".join(
                f"{symbol_of(t)} ({_external(self.tree, t) or 'built outside the source'})" for t in unknown
            )
            return Finding("unchecked", s, f"signature not readable from the engine source: {why}")
        t, sig, msgs = fails[0]
        sev = "break" if len(fails) > len(oks) else "warning"
        extra = f" (binds on {_names([o[0] for o in oks])})" if oks else ""
        return Finding(sev, s, "; ".join(msgs) + extra, symbol_of(t), _sig_text(sig), tilde(sig.location))

    # -----------------------------------------------------------------------------------------
    def judge_opaque(self, s: Site) -> Finding:
        """A site on an engine object of unknown type: inferred from the names read on it, or unchecked."""
        oid = s.recv.oid if s.recv is not None else ""
        if s.kind == "call":
            parent, _, attr = oid.rpartition(".")
            members = [self.tree.member(c, attr) for c in self.inferred.get((parent, attr)) or ()]
            methods = [m for m in members if m is not None and m.kind == "function"]
            if methods:
                return self._bind(s, methods, s.n_pos)
            return Finding("unchecked", s, f"calls an engine object of unknown type ({oid})")
        if s.kind == "store" or s.name in self.stores[oid]:
            return Finding("ok", s, "set by the package")
        evidence = self.evidence(oid) - {s.name} - self.broken(oid)
        if len(evidence) < MIN_EVIDENCE:
            return Finding("unchecked", s, f"receiver is an engine object of unknown type ({oid})")
        cands = self.index.candidates(evidence)
        if not cands:
            return Finding("unchecked", s, f"receiver is an engine object of unknown type ({oid}); no engine "
                           "class has all the names read on it")  # fmt: skip
        return self._inferred(s, oid, evidence, cands)

    def evidence(self, oid: str) -> frozenset[str]:
        """The names the package reads on the object ``oid`` and does not set itself."""
        return frozenset(n for n in self.reads[oid] - self.stores[oid] if not n.startswith("__"))

    def broken(self, oid: str) -> set[str]:
        """Names read on ``oid`` that most classes having the other names lack: left out of the evidence
        for the others (a renamed method must not hide the receiver's classes)."""
        if oid not in self._broken:
            names, out = self.evidence(oid), set()
            grew = True
            while grew:
                grew = False
                for a in sorted(names - out):
                    rest = names - {a} - out
                    cands = self.index.candidates(rest) if len(rest) >= MIN_EVIDENCE else []
                    lack = [c for c in cands if a not in (self.index.attrs(c) or set())]
                    if cands and 2 * len(lack) > len(cands):
                        out.add(a)
                        grew = True
            self._broken[oid] = out
        return self._broken[oid]

    def _inferred(self, s: Site, oid: str, evidence: frozenset[str], cands: list[Found]) -> Finding:
        """The verdict on ``s.name`` read on ``oid``, whose classes are ``cands`` (inferred from ``evidence``)."""
        have = [c for c in cands if s.name in (self.index.attrs(c) or set())]
        lack = [c for c in cands if c not in have]
        if have:
            self.inferred[(oid, s.name)] = have
        receiver = (f"receiver {oid}: {len(cands)} engine class(es) have the other names read on it "
                    f"({', '.join(sorted(evidence))}), e.g. {_names(cands[:3])}")  # fmt: skip
        if not lack:
            return Finding("ok", s, f"{receiver}; all have {s.name!r}")
        similar = similar_names(s.name, [self.index.attrs(c) or set() for c in lack])
        sample, installed, loc = lack[0], "", tilde(lack[0].location)
        m = self.tree.member(sample, similar[0]) if similar else None
        sig = signature(self.tree, m) if m is not None and m.kind == "function" else None
        symbol = symbol_of(sample)
        if sig is not None and m is not None:
            symbol, installed, loc = (
                symbol_of(m),
                f"{sample.node.name}.{similar[0]}{sig.text}",
                tilde(sig.location),
            )
        they = f"; they have {similar}" if similar else ""
        if len(lack) > len(have) and len(evidence) >= BREAK_EVIDENCE:
            only = f"; only {_names(have)} still has it" if have else ""
            msg = f"no {s.name!r} on {len(lack)} of {len(cands)} classes it can be (renamed or removed?){they}{only}"
            return Finding("break", s, f"{msg} -- {receiver}", symbol, installed, loc)
        msg = f"no {s.name!r} on {_names(lack)} ({len(lack)} of {len(cands)} classes it can be){they}"
        if len(lack) > len(have):
            msg += f" (a warning: fewer than {BREAK_EVIDENCE} other names read on it to infer its classes)"
        return Finding("warning", s, f"{msg} -- {receiver}", symbol, installed, loc)


def check_sites(sites: list[Site], tree: SourceTree, index: ClassIndex | None = None) -> list[Finding]:
    """A :class:`Finding` for every site, judged against the engine source in ``tree``."""
    return Checker(tree, index or ClassIndex(tree, _engine_of(sites))).run(sites)


def _engine_of(sites: list[Site]) -> str:
    """The engine package the sites import (``vllm`` when none)."""
    for s in sites:
        if s.kind == "import":
            return s.name.split(".")[0].split(":")[0]
    return "vllm"


def _names(classes: list[Found]) -> str:
    """Up to four class names, and how many more."""
    names = [c.node.name for c in classes]
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _hint(name: str, names: set[str]) -> str:
    """``; similar names there: [...]`` for a missing ``name``, '' when none looks like it."""
    close = similar_names(name, [names])
    return f"; similar names there: {close}" if close else ""


def _tokens_match(a: str, b: str) -> bool:
    """Whether two words of names match: equal, or one (4+ letters) starts the other (``embed``/``embeddings``)."""
    return a == b or (min(len(a), len(b)) >= 4 and (a.startswith(b) or b.startswith(a)))


def _token_score(a: str, b: str) -> float:
    """Share of the ``_``-separated words of ``a`` and ``b`` that match (equal, or one a prefix of the other)."""
    ta, tb = [t for t in a.lower().split("_") if t], [t for t in b.lower().split("_") if t]
    if not ta or not tb:
        return 0.0
    return sum(1 for t in ta if any(_tokens_match(t, u) for u in tb)) / max(len(ta), len(tb))


def similar_names(name: str, attr_sets: list[set[str]]) -> list[str]:
    """Names most of ``attr_sets`` share that look like ``name`` renamed (``get_input_embeddings`` ->
    ``embed_input_ids``): up to three, best first."""
    counts = Counter(n for attrs in attr_sets for n in attrs if n and n != name and not n.startswith("__"))
    need = max(1, int(0.8 * len(attr_sets)))
    scored = []
    for n, c in counts.items():
        if c >= need:
            t, r = _token_score(name, n), difflib.SequenceMatcher(None, name, n).ratio()
            if t >= 0.5 or r >= 0.6:
                scored.append((t + r, n))
    return [n for _, n in sorted(scored, reverse=True)[:3]]


def _external(tree: SourceTree, cls: Found) -> str:
    """Base classes of ``cls`` (or its owner's) outside the engine source that may define names, '' if none."""
    c = cls.owner if cls.kind != "class" and cls.owner is not None else cls
    if c.kind != "class":
        return ""
    ext = [n for n in tree.mro(c)[1] if n.split(".")[-1] not in _TRIVIAL_BASES]
    return f"derives from {', '.join(sorted(set(ext)))}" if ext else ""


def _is_protocol(tree: SourceTree, cls: Found) -> bool:
    """Whether ``cls`` is a ``Protocol``: objects typed with it may have any other names."""
    return any(n.split(".")[-1] == "Protocol" for n in tree.mro(cls)[1])


def _why_open(tree: SourceTree, cls: Found) -> str:
    """Why names missing from ``cls``'s source may still exist on its instances."""
    if _is_protocol(tree, cls):
        return "a Protocol: the object may be any class having its names"
    return _external(tree, cls) or "__getattr__"


def _module_names(tree: SourceTree, module: str) -> set[str]:
    """Names a module defines or imports at top level."""
    parsed = tree.parse(module)
    names: set[str] = set()
    for s in top_statements(parsed.body if parsed else []):
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(s.name)
        elif isinstance(s, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in s.names}
        elif isinstance(s, ast.Assign):
            names |= {t.id for t in s.targets if isinstance(t, ast.Name)}
    return names


def _module_getattr(tree: SourceTree, module: str) -> bool:
    """Whether a module defines ``__getattr__`` (its names are built at run time)."""
    parsed = tree.parse(module)
    return any(
        isinstance(s, ast.FunctionDef) and s.name == "__getattr__"
        for s in top_statements(parsed.body if parsed else [])
    )
