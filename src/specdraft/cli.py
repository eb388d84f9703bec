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
import json
import os
import re
import signal
import sys
import threading
import types
import typing
from importlib import import_module
from pathlib import Path

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
    """Each parameter's text in the docstring's `Args:` section, at whatever indentation the section sits."""
    doc = inspect.getdoc(fn) or ""
    out, cur, indent = {}, None, None
    for line in doc.splitlines():
        if line.strip() == "Args:":
            indent = len(line) - len(line.lstrip())
            continue
        if indent is None:
            continue
        depth = len(line) - len(line.lstrip())
        m = re.match(r"^(\w+):\s*(.*)$", line.strip())
        if m and depth == indent + 4:
            cur = m.group(1)
            out[cur] = m.group(2)
        elif line.strip() and depth > indent + 4 and cur:
            out[cur] += " " + line.strip()
        elif line.strip():
            indent = None
    return out


def _field_docs(cls) -> dict[str, str]:
    """Field docs of a dataclass: the `# comment`s on each field's lines (a field written over several lines,
    its comment wrapped inside the parentheses, included), read with `ast` and `tokenize`."""
    import ast
    import io
    import textwrap
    import tokenize

    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        src = textwrap.dedent(inspect.getsource(klass))
        comments = {}
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            text = tok.string.lstrip("#").strip()
            if tok.type == tokenize.COMMENT and not text.startswith(("fmt:", "noqa", "type:")):
                comments[tok.start[0]] = text
        for node in ast.parse(src).body[0].body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                lines = range(node.lineno, (node.end_lineno or node.lineno) + 1)
                found = [comments[n] for n in lines if n in comments]
                if found:
                    docs[node.target.id] = " ".join(found)
    return docs


def _unwrap(tp):
    """(base type, is_list, choices) of an annotation such as `int`, `list[int] | None`, `Literal["a", "b"]`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _unwrap(args[0])
    if origin in (list, tuple):
        base, _, choices = _unwrap(typing.get_args(tp)[0])
        return base, True, choices
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        return type(choices[0]), False, choices
    return tp, False, None


def _shown(default) -> str:
    """How --help shows a default."""
    if isinstance(default, bool):
        return "on" if default else "off"
    if default is None or default == []:
        return "none"
    if default == "":
        return "empty"
    return " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)


def _add(parser, name: str, tp, default, help_text: str, positional: bool, from_config: bool = False) -> None:
    base, is_list, choices = _unwrap(tp)
    flag = name.replace("_", "-")
    if positional and from_config:  # given by --config: the command line may still name it
        parser.add_argument(name, type=base, nargs="*" if is_list else "?", default=default,
                            help=help_text + f" (from --config: {default})")  # fmt: skip
    elif positional:
        parser.add_argument(name, type=base, nargs="+" if is_list else None, help=help_text)
    elif base is bool:
        parser.add_argument(f"--{flag}", dest=name, action=argparse.BooleanOptionalAction, default=default,
                            help=f"{help_text} (default: {_shown(default)})")  # fmt: skip
    else:
        parser.add_argument(f"--{flag}", dest=name, type=base, nargs="+" if is_list else None, default=default,
                            choices=choices, metavar=None if choices else flag.upper().replace("-", "_"),
                            help=f"{help_text} (default: {_shown(default)})")  # fmt: skip


def build_parser(fns: dict, config: dict | None = None) -> tuple[argparse.ArgumentParser, dict]:
    """The parser of every command in `fns`; `config` (name -> value, from --config) replaces defaults."""
    config = config or {}
    parser = _Parser(prog="specdraft", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
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
                group = p.add_argument_group(f"{cmd} settings")
                for f in dataclasses.fields(tp):
                    if not f.init:
                        continue
                    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
                    default = config.get(f.name, default)
                    _add(group, f.name, fhints[f.name], default, fdocs.get(f.name, ""), positional=False)
                continue
            positional = param.default is inspect.Parameter.empty
            default = config.get(pname, None if positional else param.default)
            _add(p, pname, tp, default, docs.get(pname, ""), positional, from_config=pname in config)
        p.add_argument("--config", metavar="FILE", default=None,
                       help="read the settings from FILE (JSON: the settings file a run writes beside its output, "
                            "or an object of option -> value); options given here override it")  # fmt: skip
        p.add_argument("--print-config", action="store_true",
                       help="print the settings this command would run with (a valid --config FILE) and exit")  # fmt: skip
        for action in p._actions:  # each option given on the command line is recorded in `_given`
            if action.dest not in ("help", "config", "print_config"):
                action.__class__ = _recording(type(action))
    return parser, dataclass_params


#: what users of other trainers type -> our option (speculators, SpecForge, EAGLE's scripts, HF Trainer)
SYNONYMS = {
    "learning-rate": "lr", "num-epochs": "epochs", "num-train-epochs": "epochs", "ttt-length": "ttt-steps",
    "ttt-len": "ttt-steps", "ttt-steps-num": "ttt-steps", "max-seq-length": "max-length", "max-len": "max-length",
    "draft-vocab": "draft-vocab-size", "target-model-path": "target", "target-model": "target",
    "verifier": "target", "save-interval": "checkpoint-every", "save-steps": "checkpoint-every",
    "eval-interval": "val-every", "eval-steps": "val-every", "log-interval": "log-every",
    "log-steps": "log-every", "warmup-steps": "warmup-ratio", "batch-size": "max-tokens",
    "tp-size": "tensor-parallel-size", "tp": "tensor-parallel-size", "resume-from-checkpoint": "resume",
    "num-speculative-tokens": "k", "speculative-tokens": "k",
}  # fmt: skip


class _Parser(argparse.ArgumentParser):
    """argparse, where an unknown option names the nearest one the command has (or the one it is called here)."""

    def error(self, message: str):
        m = re.match(r"unrecognized arguments: (.*)", message)
        if m:
            hints = [h for h in (self._suggest(a) for a in m.group(1).split() if a.startswith("--")) if h]
            if hints:
                message += "; " + "; ".join(hints)
        super().error(message)

    def _suggest(self, arg: str) -> str:
        import difflib

        word = arg.split("=")[0]
        cmd = self._subcommand()
        options = {s for a in cmd._actions for s in a.option_strings if s.startswith("--")} if cmd else set()
        if not options:
            return ""
        near = SYNONYMS.get(word[2:])
        if near and f"--{near}" in options:
            return f"{word}: specdraft {cmd.prog.split()[-1]} calls it --{near}"
        close = difflib.get_close_matches(word, options, n=1, cutoff=0.7)
        return f"{word}: did you mean {close[0]}?" if close else ""

    def _subcommand(self) -> argparse.ArgumentParser | None:
        """The parser of the command being parsed (self when it is one)."""
        if self.prog != "specdraft":
            return self
        wanted = next((a for a in _ARGV if not a.startswith("-")), None)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(wanted) or (
                    next(iter(action.choices.values())) if len(action.choices) == 1 else None
                )
        return None


_ARGV: list[str] = []  # the command line being parsed (for _Parser's suggestions)
_RECORDING: dict[type, type] = {}


def _recording(cls: type) -> type:
    """`cls`, recording its destination in the namespace's `_given` set when the parser calls it."""
    if cls not in _RECORDING:

        def __call__(self, parser, namespace, values, option_string=None):
            given = getattr(namespace, "_given", set())
            if option_string is not None or values not in (None, []):  # a positional left out is not given
                given.add(self.dest)
            namespace._given = given
            return cls.__call__(self, parser, namespace, values, option_string)

        _RECORDING[cls] = type(cls.__name__, (cls,), {"__call__": __call__})
    return _RECORDING[cls]


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
    from specdraft import runtime

    runtime.GIVEN.clear()
    runtime.RESOLVED.clear()
    runtime.FROM_COMMAND_LINE = True
    try:
        return _run(fns, argv, wanted)
    finally:  # a later call from Python in this process is not this command line's
        runtime.FROM_COMMAND_LINE = False
        runtime.GIVEN.clear()


def _run(fns: dict, argv: list[str], wanted: str | None) -> int:
    """Parse `argv` (with its --config), run the command, record its settings; its exit status."""
    try:
        cmd, kwargs, settings = _parse(fns, argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"specdraft {wanted}: error: {e}", file=sys.stderr)
        return 2
    if settings is None:  # --print-config: printed
        return 0
    fn = fns[cmd]
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
    _record(cmd, settings)
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def _parse(fns: dict, argv: list[str]) -> tuple[str, dict, dict | None]:
    """(command, its keyword arguments, its flat settings: option name -> value), with --config FILE's values
    (or, for `train --resume`, the settings OUT/train_settings.json recorded) where the command line gives
    none; the settings are None after --print-config printed them. Records where each came from in GIVEN."""
    from specdraft import runtime

    _ARGV[:] = argv
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--print-config", action="store_true")
    known, _ = pre.parse_known_args(argv)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    config, source = {}, ""
    if known.config and wanted in fns:
        config, source = _config(fns[wanted], wanted, known.config), f"--config {known.config}"
    loose = known.print_config and wanted in fns
    if loose:  # --print-config alone: the positionals may be left out
        fn = fns[wanted]
        config = {
            p: None for p, v in inspect.signature(fn).parameters.items() if v.default is v.empty
        } | config
    parser, dc_params = build_parser(fns, config)
    ns = vars(parser.parse_args(argv))
    cmd = ns.pop("command")
    if cmd == "train" and ns.get("resume") and not known.config:
        recorded = Path(ns["out"]) / "train_settings.json"
        if recorded.is_file():  # --resume: the recorded settings, unless the command line says otherwise
            config, source = _config(fns[cmd], cmd, str(recorded)), f"recorded in {recorded}"
            parser, dc_params = build_parser({cmd: fns[cmd]}, config)
            ns = vars(parser.parse_args(argv))
            ns.pop("command")
    given = ns.pop("_given", set())
    ns.pop("config", None)
    print_config = ns.pop("print_config", False)
    for k in config:
        runtime.GIVEN[k] = source
    for k in given:
        if not (k in config and ns.get(k) == config[k]):
            runtime.GIVEN[k] = "command line"
    kwargs, settings = {}, dict(ns)
    for pname, cls in dc_params[cmd].items():
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        kwargs[pname] = cls(**{n: ns.pop(n) for n in names})
    kwargs.update(ns)
    if print_config:
        print(json.dumps(runtime.settings_doc(cmd, settings), indent=2))
        return cmd, kwargs, None
    if source.startswith("recorded"):
        changed = sorted(k for k in given if k != "resume" and settings.get(k) != config.get(k))
        print(f"specdraft {cmd}: --resume: the settings {source}, with the command line's "
              f"{', '.join('--' + k.replace('_', '-') for k in changed) or 'none'} over them",
              file=sys.stderr)  # fmt: skip
    return cmd, kwargs, settings


def _config(fn, cmd: str, path: str) -> dict:
    """The settings of a --config FILE for `cmd`, every name checked (an unknown one names its nearest)."""
    import difflib

    from specdraft import runtime

    config = runtime.read_settings(path, cmd)
    names = set()
    hints = typing.get_type_hints(fn)
    for pname in inspect.signature(fn).parameters:
        tp = hints.get(pname, str)
        names |= (
            {f.name for f in dataclasses.fields(tp) if f.init} if dataclasses.is_dataclass(tp) else {pname}
        )
    bad = []
    for k in sorted(set(config) - names):
        near = difflib.get_close_matches(k, names, n=1)
        bad.append(f"{k!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    if bad:
        raise ValueError(f"--config {path}: `specdraft {cmd}` has no setting {', '.join(bad)}")
    return config


def _record(cmd: str, settings: dict) -> None:
    """The settings a finished command ran with, beside its output: OUT/<command>_settings.json (train writes
    its own as it starts; an export's go into its marker file, the one extra file an export holds)."""
    from specdraft import runtime

    out = settings.get("out")
    if not out or not Path(out).is_dir():
        return
    if cmd == "train":  # the EAGLE-3 loop writes its own as it starts (with the recipe's values); others here
        if not (Path(out) / "train_settings.json").exists():
            runtime.write_settings(Path(out) / "train_settings.json", cmd,
                                   {k: v for k, v in settings.items() if k != "resume"})  # fmt: skip
        return
    if cmd == "export":
        marker = Path(out) / "specdraft_export.json"
        if marker.is_file():
            runtime.write_settings(marker, cmd, settings, keep=json.loads(marker.read_text()))
        return
    runtime.write_settings(Path(out) / f"{cmd}_settings.json", cmd, settings)


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
