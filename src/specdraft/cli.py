"""The command line: one table of commands, each a typed function; flags are generated from signatures.

A parameter without default is positional; `bool` becomes --flag/--no-flag; `list[int]` takes several
values; a dataclass parameter expands into one flag per field, documented by the field's trailing
comment. Help texts come from the function's docstring `Args:` section.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import inspect
import os
import re
import signal
import sys
import threading
import types
import typing
from importlib import import_module

# name -> "module:function"; imported lazily so `specdraft --help` and `doctor` start fast
COMMANDS = {
    "regenerate": "specdraft.data.regenerate:regenerate",
    "prepare": "specdraft.data.prepare:prepare",
    "extract": "specdraft.capture.extract:extract",
    "verify": "specdraft.data.store:verify_dirs",
    "train": "specdraft.train.loop:train",
    "eval": "specdraft.eval.command:evaluate",
    "export": "specdraft.export:export",
    "doctor": "specdraft.doctor.command:doctor",
    "quickstart": "specdraft.quickstart:quickstart",
}

# name -> what to do after the command was stopped (Ctrl-C, SIGTERM, a full disk): each resumes its own way
RESUME_HINTS = {
    "regenerate": "rerun the same command to resume",
    "prepare": "rerun the same command (prepare starts over)",
    "extract": "rerun the same command to resume",
    "verify": "rerun the same command (verify only reads: nothing to resume)",
    "train": "rerun with --resume to continue from the newest checkpoint (without it if none was written yet)",
    "eval": "rerun the same command (eval starts over)",
    "export": "rerun the same command (export starts over; it leaves no partial directory)",
    "doctor": "rerun the same command (doctor only reads)",
    "quickstart": "rerun the same command without --fresh to resume where it stopped",
}


def _arg_docs(fn) -> dict[str, str]:
    doc = inspect.getdoc(fn) or ""
    out, cur = {}, None
    in_args = False
    for line in doc.splitlines():
        if line.strip() == "Args:":
            in_args = True
            continue
        if in_args:
            m = re.match(r"^\s{4}(\w+):\s*(.*)$", line)
            if m:
                cur = m.group(1)
                out[cur] = m.group(2)
            elif line.startswith("        ") and cur:
                out[cur] += " " + line.strip()
            elif line.strip():
                in_args = False
    return out


def _field_docs(cls) -> dict[str, str]:
    """One-line field docs of a dataclass: the trailing `# comment` of each field line."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        for line in inspect.getsource(klass).splitlines():
            m = re.match(r"^\s+(\w+)\s*:[^#]*#\s*(.*)$", line)
            if m:
                docs[m.group(1)] = m.group(2)
    return docs


def _unwrap(tp):
    """(base type, is_list) of an annotation such as `int`, `list[int] | None`, `str | None`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _unwrap(args[0])
    if origin in (list, tuple):
        return typing.get_args(tp)[0], True
    return tp, False


def _add(parser, name: str, tp, default, help_text: str, positional: bool) -> None:
    base, is_list = _unwrap(tp)
    flag = name.replace("_", "-")
    if positional:
        parser.add_argument(name, type=base, nargs="+" if is_list else None, help=help_text)
    elif base is bool:
        parser.add_argument(f"--{flag}", dest=name, action=argparse.BooleanOptionalAction, default=default,
                            help=help_text)  # fmt: skip
    else:
        shown = f" (default: {default})" if default not in (None, "", []) else ""
        parser.add_argument(f"--{flag}", dest=name, type=base, nargs="+" if is_list else None, default=default,
                            help=help_text + shown)  # fmt: skip


def build_parser(fns: dict) -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="specdraft", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dataclass_params: dict[str, dict[str, type]] = {}
    for cmd, fn in fns.items():
        doc = inspect.getdoc(fn) or ""
        p = sub.add_parser(
            cmd, help=doc.splitlines()[0] if doc else "", description=doc.split("\n\nArgs:")[0]
        )
        hints = typing.get_type_hints(fn)
        docs = _arg_docs(fn)
        dataclass_params[cmd] = {}
        for pname, param in inspect.signature(fn).parameters.items():
            tp = hints.get(pname, str)
            if dataclasses.is_dataclass(tp):
                dataclass_params[cmd][pname] = tp
                fdocs = _field_docs(tp)
                fhints = typing.get_type_hints(tp)
                group = p.add_argument_group(pname)
                for f in dataclasses.fields(tp):
                    if not f.init:
                        continue
                    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
                    _add(group, f.name, fhints[f.name], default, fdocs.get(f.name, ""), positional=False)
                continue
            positional = param.default is inspect.Parameter.empty
            _add(p, pname, tp, None if positional else param.default, docs.get(pname, ""), positional)
    return parser, dataclass_params


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # resolve only the command being run (others may need optional engines); help lists all names
    wanted = next((a for a in argv if not a.startswith("-")), None)
    fns = {}
    for name, target in COMMANDS.items():
        if wanted in (None, name) or wanted not in COMMANDS:
            mod, fn = target.split(":")
            try:
                fns[name] = getattr(import_module(mod), fn)
            except ImportError as e:
                if wanted == name:
                    raise SystemExit(f"specdraft {name}: cannot import {mod} ({e})") from e
    parser, dc_params = build_parser(fns)
    ns = vars(parser.parse_args(argv))
    cmd = ns.pop("command")
    fn = fns[cmd]
    kwargs = {}
    for pname, cls in dc_params[cmd].items():
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        kwargs[pname] = cls(**{n: ns.pop(n) for n in names})
    kwargs.update(ns)
    try:
        with _sigterm_as_interrupt():
            result = fn(**kwargs)
    except Terminated:
        print(f"specdraft {cmd}: terminated (SIGTERM); {_hint(cmd, argv, kwargs)}", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"specdraft {cmd}: interrupted; {_hint(cmd, argv, kwargs)}", file=sys.stderr)
        return 130
    except Exception as e:
        # user errors (bad input, paths, a full disk, engine refusals) in one line; anything else is a bug
        if os.environ.get("SPECDRAFT_DEBUG") or not (isinstance(e, _USER_ERRORS) or _disk_full(e)):
            raise
        print(f"specdraft {cmd}: error: {_user_message(e, _hint(cmd, argv, kwargs))}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def _hint(cmd: str, argv: list[str], kwargs: dict) -> str:
    """What to do after `cmd` stopped: its RESUME_HINTS line; for train, the exact command that resumes it.
    Progress bars a failed stage left open are closed first, so the message that follows starts a line."""
    _close_bars()
    if cmd == "train":
        from specdraft.train.loop import resume_hint

        return resume_hint(argv, kwargs["out"])
    return RESUME_HINTS.get(cmd, "rerun the same command")


def _close_bars() -> None:
    """Close every tqdm bar still open (a stage stopped by an error leaves its bar mid-line)."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt: the command stops the same clean way."""


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """While a command runs, SIGTERM raises `Terminated` in this process (a second SIGTERM, or one that a
    forked child receives, does what it does by default: end the process). Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pid = os.getpid()

    def on_sigterm(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if os.getpid() != pid:  # a forked child inherited this handler: die as it would have
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Terminated

    before = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


_USER_ERRORS = (ValueError, FileNotFoundError, OSError, RuntimeError)


def _disk_full(e: BaseException) -> bool:
    """A full disk, however the writing library reports it (OSError ENOSPC, safetensors' or torch's errors)."""
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)


def _user_message(e: BaseException, hint: str) -> str:
    """One line for an error the user can act on (set SPECDRAFT_DEBUG=1 for the traceback); `hint` says how
    the command resumes after a full disk."""
    if _disk_full(e):
        name = getattr(e, "filename", None)
        where = f" writing {name}" if name else ""
        return f"no space left on the device{where}: free space or point the output at a larger disk, then {hint}"
    return str(e) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
