"""The command line: one table of commands, each a typed function; tyro builds each command's options from its
signature.

A parameter without default is positional; `bool` becomes --flag/--no-flag; `list[int]` takes several
values; `Literal[...]` lists its choices; a dataclass parameter spreads into one option per field,
documented by the field's comment (or docstring). Help texts come from the function's docstring `Args:`
section. Around tyro: --config FILE and --print-config, the settings each run records, `train --resume`
reading them back, and the names other trainers give our options.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import inspect
import json
import os
import signal
import sys
import threading
import types as types_mod
import typing
from importlib import import_module
from pathlib import Path
from typing import Annotated, Any

ABOUT = "Train speculative-decoding drafts (EAGLE-3, DFlash) on a target's own hidden states; serve them with vLLM and SGLang."

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


def _help_texts(fn) -> dict[str, str]:
    """Each parameter's text in the docstring's `Args:` section, its line breaks joined (docstring_parser)."""
    import textwrap

    import docstring_parser

    first, _, rest = (inspect.getdoc(fn) or "").partition("\n")
    doc = docstring_parser.parse(first + "\n" + textwrap.dedent(rest))  # an Args: section indented as a body
    return {p.arg_name: " ".join((p.description or "").split()) for p in doc.params}


def _merged_positionals(fn) -> list[str]:
    """The positionals tyro takes as one list: a list positional and those after it (`prepare DATA... OUT`);
    tyro's parser gives a list positional every word, so the command line's last words are split off here."""
    hints, names = typing.get_type_hints(fn), []
    for name, p in inspect.signature(fn).parameters.items():
        if p.default is not inspect.Parameter.empty:
            continue
        if names or typing.get_origin(hints.get(name)) is list:
            names.append(name)
    return names if len(names) > 1 else []


def command_signature(cmd: str, fn, config: dict | None = None, loose: bool = False) -> inspect.Signature:
    """`fn`'s signature as the command line shows it (tyro reads it): a parameter without default is positional,
    a dataclass parameter spreads its fields as options of their own (documented by each field's comment or
    docstring), `config` (name -> value, from --config) replaces defaults, and --config/--print-config are
    added. `loose`: positionals may be left out (--print-config alone)."""
    import tyro

    config = config or {}
    hints, docs, merged = typing.get_type_hints(fn), _help_texts(fn), _merged_positionals(fn)
    params = []
    for name, p in inspect.signature(fn).parameters.items():
        tp, default, positional = hints.get(name, str), config.get(name, p.default), False
        if dataclasses.is_dataclass(tp):
            fields = {f.name for f in dataclasses.fields(tp) if f.init}
            default = tp(**{k: v for k, v in config.items() if k in fields})
            ann = Annotated[tp, tyro.conf.OmitArgPrefixes, tyro.conf.arg(name=cmd, help="")]
        elif name in merged[1:]:
            continue
        elif name in merged:  # DATA... OUT: one list of words, split again in _parse_command
            name, tp, positional = "_".join(merged), list[str], True
            given = [config[n] for n in merged if n in config]
            default = [*given[0], *given[1:]] if len(given) == len(merged) else p.default
            helps = " ".join(f"{n.upper()}: {docs.get(n, '')}" for n in merged)
            ann = Annotated[list[str], tyro.conf.Positional, tyro.conf.arg(
                help=helps, metavar=" ".join(n.upper() + ("..." if n == merged[0] else "") for n in merged))]  # fmt: skip
        elif p.default is inspect.Parameter.empty:
            positional = True
            ann = Annotated[
                tp, tyro.conf.Positional, tyro.conf.arg(help=docs.get(name, ""), metavar=name.upper())
            ]
        else:
            ann = Annotated[tp, tyro.conf.arg(help=docs.get(name, ""), metavar=_optional_list_metavar(tp))]
        if positional and default is inspect.Parameter.empty and loose:
            default, ann = None, Annotated[(ann.__origin__ | None, *ann.__metadata__)]
        elif positional and default is inspect.Parameter.empty:  # tyro shows a list left out as "(default: )"
            ann = Annotated[
                (ann.__origin__, *ann.__metadata__, tyro.conf.arg(help_behavior_hint="(required)"))
            ]
        params.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default,
                                        annotation=ann))  # fmt: skip
    kw = inspect.Parameter.KEYWORD_ONLY
    params += [
        inspect.Parameter("config", kw, default=None, annotation=Annotated[str | None, tyro.conf.arg(
            metavar="FILE", help="read the settings from FILE (JSON: the settings file a run writes beside its "
            "output, or an object of option -> value); options given here override it")]),
        inspect.Parameter("print_config", kw, default=False, annotation=Annotated[bool, tyro.conf.FlagCreatePairsOff,
            tyro.conf.arg(help="print the settings this command would run with (a valid --config FILE) and exit")]),
    ]  # fmt: skip
    return inspect.Signature(params)


def _arguments(fn, sig: inspect.Signature):
    """A function with `fn`'s docs and `sig`, returning the arguments it was called with (what tyro parsed)."""

    def arguments(*args, **kwargs) -> dict:
        return dict(sig.bind(*args, **kwargs).arguments)

    arguments.__signature__ = sig  # type: ignore[attr-defined]
    arguments.__annotations__ = {p.name: p.annotation for p in sig.parameters.values()}
    arguments.__doc__ = (inspect.getdoc(fn) or "").split("\n\nArgs:")[0]
    arguments.__name__, arguments.__module__ = fn.__name__, fn.__module__
    return arguments


#: how tyro builds every command: no `None` on the command line (an option left out keeps its default None)
TYRO_CONFIG = ("DisallowNone",)


def command_parser(cmd: str, fn, config: dict | None = None, loose: bool = False):
    """The argparse parser tyro builds for `specdraft CMD` (what --help prints; the tests read its options)."""
    import warnings

    import tyro

    conf = tuple(getattr(tyro.conf, m) for m in TYRO_CONFIG)
    with warnings.catch_warnings():  # tyro 1.0 marks get_parser deprecated, with no replacement yet
        warnings.simplefilter("ignore", DeprecationWarning)
        return tyro.extras.get_parser(_arguments(fn, command_signature(cmd, fn, config, loose)),
                                      prog=f"specdraft {cmd}", config=conf)  # fmt: skip


def _parse_command(cmd: str, fn, args: list[str], config: dict, loose: bool) -> dict:
    """tyro's parse of `args` for `cmd`: parameter -> value, a dataclass parameter built from its fields."""
    import tyro

    _refuse_other_names(cmd, fn, args)
    conf = tuple(getattr(tyro.conf, m) for m in TYRO_CONFIG)
    parsed = tyro.cli(_arguments(fn, command_signature(cmd, fn, config, loose)), args=args,
                      prog=f"specdraft {cmd}", config=conf)  # fmt: skip
    merged = _merged_positionals(fn)
    if merged:  # DATA... OUT: the last words are the positionals after the list
        words = parsed.pop("_".join(merged))
        if words is not None and len(words) < len(merged):
            raise ValueError(f"expected {merged[0].upper()}... {' '.join(n.upper() for n in merged[1:])} (at "
                             f"least {len(merged)} words), got {len(words)}: {words}")  # fmt: skip
        rest = len(merged) - 1
        values = [None] * len(merged) if words is None else [words[:-rest], *words[-rest:]]
        parsed = {**dict(zip(merged, values)), **parsed}
    missing = [n.upper() for n, p in inspect.signature(fn).parameters.items()
               if p.default is inspect.Parameter.empty and parsed.get(n) in (None, []) and not loose]  # fmt: skip
    if missing:  # tyro gives a list positional left out as []
        raise ValueError(f"missing {' '.join(missing)} (see `specdraft {cmd} --help`)")
    return parsed


#: what users of other trainers type -> our option (speculators, SpecForge, EAGLE's scripts, HF Trainer)
SYNONYMS = {
    "learning-rate": "lr", "num-epochs": "epochs", "num-train-epochs": "epochs", "ttt-length": "ttt-steps",
    "ttt-len": "ttt-steps", "ttt-steps-num": "ttt-steps", "max-seq-length": "max-length", "max-len": "max-length",
    "draft-vocab": "draft-vocab-size", "target-model-path": "target", "target-model": "target",
    "verifier": "target", "save-interval": "checkpoint-every", "save-steps": "checkpoint-every",
    "eval-interval": "val-every", "eval-steps": "val-every", "log-interval": "log-every",
    "log-steps": "log-every", "warmup-steps": "warmup-ratio", "batch-size": "max-tokens",
    "tp-size": "tensor-parallel-size", "tp": "tensor-parallel-size", "resume-from-checkpoint": "resume",
    "num-speculative-tokens": "k", "speculative-tokens": "k", "from-pretrained": "init-from",
    "pretrained-draft": "init-from", "draft-model-path": "init-from", "logger": "report-to", "log-with": "report-to",
    "max-grad-norm": "grad-clip", "grad-clip-norm": "grad-clip", "clip-grad-norm": "grad-clip",
    "wandb-project": "project", "project-name": "project", "exp-name": "run-name", "run-id": "run-name",
    "seq-length": "max-length", "max-model-len": "max-length", "lr-scheduler": "schedule", "scheduler": "schedule",
    "lr-schedule": "schedule", "warmup": "warmup-ratio", "num-layers": "draft-layers", "draft-num-layers": "draft-layers",
    "loss-fn": "loss", "loss-type": "loss", "noise-std": "noise-scale", "optim": "optimizer",
    "total-seq-len": "max-length", "verifier-name-or-path": ("verifier", "target"), "speculator-type": "draft",
    "draft-arch": "draft", "per-device-train-batch-size": "max-tokens", "train-batch-size": "max-tokens",
}  # fmt: skip
#: what other trainers have that we do not, and what stands in its place
NO_EQUIVALENT = {
    "gradient-accumulation-steps": "--max-tokens is the tokens of one optimizer step, summed over all "
                                   "ranks; raise it for a larger step",
    "dist-timeout": "the process group keeps torch's default timeout",
    "embedding-key": "the target's embedding is found by the names its model class gives its modules",
    "draft-model-config": "the draft's shape is --draft, --draft-layers and --draft-vocab-size (its other "
                          "sizes follow the target's)",
    "attention-backend": "the draft attends with torch's scaled_dot_product_attention, which picks its "
                         "kernel for the device (--attention-chunk bounds its memory)",
}  # fmt: skip


def other_name(name: str, options) -> str:
    """Where another trainer's option `name` (`--learning-rate`, `learning_rate`) is in `options` (ours, spelled
    `--x`), in words ("calls it --lr", "has no such setting: ..."), or "" when it is no other trainer's name we
    know."""
    key = name.lstrip("-").replace("_", "-")
    ours = SYNONYMS.get(key, ())
    near = next((o for o in ((ours,) if isinstance(ours, str) else ours) if f"--{o}" in options), None)
    if near:
        return f"calls it --{near}"
    return f"has no such setting: {NO_EQUIVALENT[key]}" if key in NO_EQUIVALENT else ""


#: what users of other trainers type for a positional (the README's table names --output-dir)
POSITIONAL_NAMES = {
    "output-dir": "out", "output": "out", "out-dir": "out", "save-path": "out", "save-dir": "out",
    "output-path": "out", "data-path": "DATA", "train-data-path": "DATA", "dataset": "DATA", "data": "DATA",
    "train-data": "DATA", "hidden-states-path": "DATA", "data-dir": "DATA",
}  # fmt: skip


def _option_names(fn) -> dict[str, tuple[str, bool]]:
    """`--flag` -> (parameter or field name, whether it is a flag pair) for every option of `fn`."""
    hints, out = typing.get_type_hints(fn), {}
    for name, p in inspect.signature(fn).parameters.items():
        tp = hints.get(name, str)
        pairs = [(f.name, typing.get_type_hints(tp)[f.name]) for f in dataclasses.fields(tp) if f.init] if (
            dataclasses.is_dataclass(tp)) else [(name, tp)] if p.default is not inspect.Parameter.empty else []  # fmt: skip
        for n, t in pairs:
            out["--" + n.replace("_", "-")] = (n, t is bool)
    out.update({"--config": ("config", False), "--print-config": ("print_config", False)})
    return out


def _refuse_other_names(cmd: str, fn, args: list[str]) -> None:
    """Every option this command does not have, in one argparse-style line (exit 2): ours where another trainer
    names it otherwise, the positional where the name is one, else the nearest of ours."""
    import difflib

    options = _option_names(fn)
    flags = set(options) | {"--no-" + o[2:] for o, (_, pair) in options.items() if pair} | {"-h", "--help"}
    positionals = [
        n for n, p in inspect.signature(fn).parameters.items() if p.default is inspect.Parameter.empty
    ]
    hints = []
    for a in args:
        word = a.split("=")[0]
        if not word.startswith("--") or word in flags:
            continue
        said = other_name(word, options)
        pos = POSITIONAL_NAMES.get(word[2:])
        if said:
            hints.append((word, f"{word}: specdraft {cmd} {said}"))
        elif pos and positionals:
            spelled = " ".join(p.upper() for p in positionals)
            which = "the last" if pos == "out" else "the first"
            hints.append((word, f"{word}: {which} positional is it (specdraft {cmd} {spelled})"))
        else:
            close = difflib.get_close_matches(word, sorted(options), n=1)
            hints.append(
                (
                    word,
                    f"{word}: " + (f"did you mean {close[0]}?" if close else f"see specdraft {cmd} --help"),
                )
            )
    if hints:
        print(f"usage: specdraft {cmd} [-h] [OPTIONS]\nspecdraft {cmd}: error: unrecognized arguments: "
              f"{' '.join(w for w, _ in hints)}; {'; '.join(h for _, h in hints)}", file=sys.stderr)  # fmt: skip
        raise SystemExit(2)


def _given(fn, args: list[str], parsed: dict, config: dict) -> set[str]:
    """The settings this command line names: its options, and the positionals it gives (not from --config)."""
    options = _option_names(fn)
    given = set()
    for a in args:
        word = a.split("=")[0]
        if word.startswith("--no-") and options.get("--" + word[5:], ("", False))[1]:
            word = "--" + word[5:]
        if word in options:
            given.add(options[word][0])
    for name, p in inspect.signature(fn).parameters.items():
        if p.default is inspect.Parameter.empty and parsed.get(name) is not None and (
                name not in config or parsed[name] != config[name]):  # fmt: skip
            given.add(name)
    return given


def _print_commands(fns: dict, wanted: str | None) -> int:
    """`specdraft`, `specdraft --help` or an unknown command: the table of commands (exit 2 when mistaken)."""
    import difflib

    lines = [f"usage: specdraft COMMAND [-h] [OPTIONS]\n\n{ABOUT}\n\ncommands:"]
    for name, fn in fns.items():
        lines.append(f"  {name:<12}{(inspect.getdoc(fn) or '').splitlines()[0]}")
    lines.append("\n`specdraft COMMAND --help` shows a command's options.")
    mistaken = wanted is not None and wanted not in ("-h", "--help")
    if mistaken:
        near = difflib.get_close_matches(wanted, list(COMMANDS), n=1)
        lines.append(
            f"specdraft: error: no command {wanted!r}" + (f"; did you mean {near[0]!r}?" if near else "")
        )
    print("\n".join(lines), file=sys.stderr if mistaken else sys.stdout)
    return 2 if mistaken else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # resolve only the command being run (others may need optional engines); the table lists all names
    wanted = argv[0] if argv else None
    fns = {}
    for name, target in COMMANDS.items():
        if wanted in (None, name) or wanted not in COMMANDS:
            mod, fn = target.split(":")
            try:
                fns[name] = getattr(import_module(mod), fn)
            except ImportError as e:
                if wanted == name:
                    raise SystemExit(f"specdraft {name}: cannot import {mod} ({e})") from e
    if wanted not in COMMANDS:
        return _print_commands(fns, wanted)
    from specdraft import runtime

    runtime.GIVEN.clear()
    runtime.RESOLVED.clear()
    runtime.FILLED.clear()
    runtime.FROM_COMMAND_LINE, runtime.COMMAND = True, wanted
    try:
        return _run(fns, argv, wanted)
    finally:  # a later call from Python in this process is not this command line's
        runtime.FROM_COMMAND_LINE, runtime.COMMAND = False, ""
        runtime.GIVEN.clear()


def _run(fns: dict, argv: list[str], cmd: str) -> int:
    """Parse `argv` (with its --config), run the command, record its settings; its exit status."""
    try:
        kwargs, settings = _parse(cmd, fns[cmd], argv[1:])
    except (ValueError, FileNotFoundError) as e:
        _say(f"specdraft {cmd}: error: {e}")
        return 2
    if settings is None:  # --print-config: printed
        return 0
    try:
        with _sigterm_as_interrupt():
            result = fns[cmd](**kwargs)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (`Terminated`): under torchrun rank 0 says it
        how = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        _say(f"specdraft {cmd}: {how}; {_hint(cmd, argv, kwargs)}")
        return 128 + signal.SIGTERM if isinstance(e, Terminated) else 130
    except Exception as e:
        # user errors (bad input, paths, a full disk, engine refusals) in one line; anything else is a bug
        if os.environ.get("SPECDRAFT_DEBUG") or not (isinstance(e, _USER_ERRORS) or _disk_full(e)):
            raise
        _say(f"specdraft {cmd}: error: {_user_message(e, _hint(cmd, argv, kwargs))}")
        return 2
    _record(cmd, settings)
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def _rank() -> int:
    """This process's rank under torchrun (0 outside it)."""
    return int(os.environ.get("RANK", "0") or 0)


def _say(line: str) -> None:
    """A line that ends the command, on stderr, said once: under torchrun every rank stops alike and rank 0 says
    it; torchrun's report of the failed ranks (ChildFailedError) gives it for each (their error files)."""
    if _rank() == 0:
        print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file and not os.path.exists(
        error_file
    ):  # torchrun's format (torch.distributed.elastic's errors)
        import time

        doc = {
            "message": {
                "message": line,
                "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))},
            }
        }
        with contextlib.suppress(OSError):
            Path(error_file).write_text(json.dumps(doc))


def launcher() -> str:
    """How this command was started, to type again: `specdraft`, or under torchrun the torchrun line of its
    ranks (nodes and processes per node; the module form, as the README starts it)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return "specdraft"
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // max(per_node, 1)
    on = f"--nnodes {nodes} " if nodes > 1 else ""
    return f"torchrun {on}--nproc_per_node {per_node} -m specdraft.cli"


def _flat(parsed: dict) -> dict:
    """Option name -> value: a dataclass parameter's fields in place of it."""
    out = {}
    for name, value in parsed.items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out |= {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
        else:
            out[name] = value
    return out


def _parse(cmd: str, fn, args: list[str]) -> tuple[dict, dict | None]:
    """(`fn`'s keyword arguments, its flat settings: option name -> value), with --config FILE's values (or, for
    `train --resume`, the settings OUT/train_settings.json recorded) where the command line gives none; the
    settings are None after --print-config printed them. Records where each came from in runtime.GIVEN."""
    from specdraft import runtime

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--print-config", action="store_true")
    known, _ = pre.parse_known_args(args)
    config, source = {}, ""
    if known.config:
        config, source = _config(fn, cmd, known.config), f"--config {known.config}"
    parsed = _parse_command(cmd, fn, args, config, loose=known.print_config)
    if cmd == "train" and parsed["cfg"].resume and not known.config:
        recorded = Path(parsed["out"]) / "train_settings.json"
        if recorded.is_file():  # --resume: the recorded settings, unless the command line says otherwise
            label = f"{recorded} (the settings the run recorded, read by --resume; fix or delete it)"
            config, source = _config(fn, cmd, str(recorded), label), f"recorded in {recorded}"
            parsed = _parse_command(cmd, fn, args, config, loose=False)
    print_config = parsed.pop("print_config")
    parsed.pop("config")
    given = _given(fn, args, parsed, config)
    settings = _flat(parsed)
    was = (
        _recorded_origins(Path(parsed["out"]) / "train_settings.json")
        if source.startswith("recorded")
        else {}
    )
    for k in config:  # --resume: where the run took each setting from, kept
        runtime.GIVEN[k] = f"{source} ({was[k]})" if k in was else source
    for k in given:
        if not (k in config and settings.get(k) == config[k]):
            runtime.GIVEN[k] = "command line"
    if print_config:
        said = ""
        if cmd == "train":  # what the run will use: every check it applies, the recipe filled from the data
            from specdraft.train.config import with_own_loss
            from specdraft.train.setup import planned

            _train_checks(parsed["shards"], parsed["out"], with_own_loss(parsed["cfg"]))
            cfg, said = planned(parsed["shards"], parsed["cfg"])
            settings.update(dataclasses.asdict(cfg))
        doc = {**runtime.settings_doc(cmd, settings), "from": runtime.origins(settings)}
        if said:
            doc["recipe"] = said
        if _rank() == 0:  # under torchrun: one file's worth, from rank 0
            print(json.dumps(doc, indent=2))
        return parsed, None
    if source.startswith("recorded"):
        changed = sorted(k for k in given if k != "resume" and settings.get(k) != config.get(k))
        print(f"specdraft {cmd}: --resume: the settings {source}, with the command line's "
              f"{', '.join('--' + k.replace('_', '-') for k in changed) or 'none'} over them",
              file=sys.stderr)  # fmt: skip
    return parsed, settings


def _recorded_origins(path: Path) -> dict[str, str]:
    """Where a run's recorded settings came from (its settings file's "from"; {} for a file without one)."""
    try:
        got = json.loads(path.read_text()).get("from")
    except (OSError, ValueError, AttributeError):
        return {}
    return {k: str(v) for k, v in got.items()} if isinstance(got, dict) else {}


def _train_checks(data: str | None, out: str | None, cfg) -> None:
    """Every check a run of `cfg` on `data` into `out` applies before anything loads (a ValueError naming all
    that is wrong, as the run would); `data` or `out` None (`--print-config` alone): the settings' own checks."""
    from specdraft.train.block.run import _out_problems, block_problems
    from specdraft.train.loop import _check, refuse_other_run

    if out:
        refuse_other_run(Path(out), cfg.draft)
    if cfg.draft == "eagle3" and data and out:
        _check(data, Path(out), cfg)
        return
    errs = block_problems(cfg) if cfg.draft == "dflash" else cfg.problems()
    errs += _out_problems(Path(out), cfg.resume) if out and cfg.draft == "dflash" else []
    if errs:
        raise ValueError("train: " + "; ".join(errs))


def _config(fn, cmd: str, path: str, label: str = "") -> dict:
    """The settings of a --config FILE for `cmd` (`label`: how errors name it), every name and type checked (an
    unknown name names its nearest)."""
    import difflib

    from specdraft import runtime

    label = label or f"--config {path}"
    config = runtime.read_settings(path, cmd, label)
    types: dict[str, Any] = {}
    hints = typing.get_type_hints(fn)
    for pname in inspect.signature(fn).parameters:
        tp = hints.get(pname, str)
        if dataclasses.is_dataclass(tp):
            fhints = typing.get_type_hints(tp)
            types.update({f.name: fhints[f.name] for f in dataclasses.fields(tp) if f.init})
        else:
            types[pname] = tp
    bad = []
    for k in sorted(set(config) - set(types)):
        said = other_name(k, {"--" + t.replace("_", "-") for t in types})
        near = difflib.get_close_matches(k, types, n=1)
        if said.startswith("calls it"):
            bad.append(f"{k!r} ({cmd} calls it {said[len('calls it --') :].replace('-', '_')!r})")
        elif said:
            bad.append(f"{k!r} ({said[len('has no such setting: ') :]})")
        else:
            bad.append(f"{k!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    if bad:
        raise ValueError(f"{label}: `specdraft {cmd}` has no setting {', '.join(bad)}")
    wrong = [w for k, v in config.items() if (w := _wrong_type(k, v, types[k]))]
    if wrong:  # the command line's own checks, in the command line's words: one line, every error
        raise ValueError(f"{label}: " + "; ".join(wrong))
    return config


def _wrong_type(name: str, value: Any, tp: Any) -> str:
    """Why `value` cannot be setting `name` of type `tp` ("" when it can): a settings file is held to what the
    command line accepts (a bool is true/false, an int no fraction, a choice one of its values)."""
    flag = "--" + name.replace("_", "-")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types_mod.UnionType:
        if value is None and type(None) in args:
            return ""
        tps = [a for a in args if a is not type(None)]
        errs = [_wrong_type(name, value, a) for a in tps]
        return "" if not all(errs) else errs[0]
    if origin is typing.Literal:
        return "" if value in args else f"{flag} must be one of {', '.join(map(str, args))}, not {value!r}"
    if origin in (list, tuple):
        if not isinstance(value, list):
            return f"{flag} must be a list, not {value!r}"
        inner = args[0] if args else Any
        return next((w for v in value if (w := _wrong_type(name, v, inner))), "")
    if tp is bool:
        return "" if isinstance(value, bool) else f"{flag} must be true or false, not {value!r}"
    if tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return "" if ok else f"{flag} must be a whole number, not {value!r}"
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return "" if ok else f"{flag} must be a number, not {value!r}"
    if tp is str:
        return "" if isinstance(value, str) else f"{flag} must be a string, not {value!r}"
    return ""


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

        hint = resume_hint(argv, kwargs["out"]).replace("`specdraft ", f"`{launcher()} ")
        if "--nnodes" in hint:
            hint += " on every node, with the rendezvous options it started with"
        return hint
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


def _optional_list_metavar(tp: Any) -> str | None:
    """`INT [INT ...]` for an optional list (`list[int] | None`), which tyro would show as `{[INT [INT ...]]}`."""
    args = typing.get_args(tp)
    if type(None) not in args or len(args) != 2:
        return None
    (inner,) = [a for a in args if a is not type(None)]
    if typing.get_origin(inner) is not list or not typing.get_args(inner):
        return None
    elem = getattr(typing.get_args(inner)[0], "__name__", "X").upper()
    return f"{elem} [{elem} ...]"


if __name__ == "__main__":
    sys.exit(main())
