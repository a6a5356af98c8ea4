"""The ``ascend-emu`` command line: the emulator's own commands, and the registry the layers above add theirs to.

    ascend-emu demo [--out DIR]             worked example kernels checked against torch, with trace and timeline
    ascend-emu model OP [options]           timing-only run of a registered op at any scale (``model OP --help``)
    ascend-emu model --list                 the registered ops and their options
    ascend-emu COMMAND [options]            the commands other layers add (quantize, eplb, serve-model, ...)

``demo`` and ``model`` take ``--sanitize`` (race-check every pod they make; the races go to stdout, or to ``races``
with --json, and the exit code is 1 when there are any) and ``--jitter-seed N`` (seeded latency perturbation).

Every command takes ``--json`` (one JSON object on stdout) and ``--quiet`` (no progress bar on stderr); the ones that
run the emulator take ``--profile NAME|FILE`` (a preset of ``ascend_emu.profile.PRESETS`` or a TOML file). A failure
prints one line on stderr naming the option and the limit and exits 2; with ``--json`` stdout also gets
``{"error": {"type", "message", "option"}}``. As the ``ascend-emu`` process (``main()`` without arguments) Ctrl-C
stops at once with exit code 130 and a closed stdout (``| head``) ends it quietly with 141.

Layers above the emulator register through the entry-point group ``ascend_emu.cli`` (pyproject.toml): each entry
names a module (``xccl.cli``) whose import registers its model ops (``@register``), commands (``@command``) and demo
stages (``@demo_stage``), so this package names none of them. A source tree run without installing it (PYTHONPATH
only) reads the entries from its own pyproject.toml; a copy of ``ascend_emu`` with neither has the core's commands.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.metadata
import inspect
import json
import math
import os
import re
import signal
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import ArgumentError, EmulatorError, NotPartitionableError

ENTRY_POINT_GROUP = "ascend_emu.cli"
SOURCE_TREE = Path(__file__).resolve().parent.parent    # holds pyproject.toml when running from a checkout


# ------------------------------------------------------------------------------------------------ the registry
@dataclass(frozen=True)
class Option:
    """One option of a model op. ``min`` / ``max``: the smallest / largest value; ``max`` may name a
    HardwareProfile field (``"aiv_per_die"``), checked against the ``--profile`` in use before the op runs.
    ``param``: the library's name for it where that differs (its errors then name this option)."""
    name: str                 # "--tokens"
    type: type
    default: object
    help: str
    choices: tuple | None = None
    min: float | None = None
    max: float | str | None = None
    param: str | None = None

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class ModelOp:
    """``ascend-emu model NAME``: ``fn(**options, trace=bool, profile=HardwareProfile)`` returns a dict with at
    least ``op``, ``modeled_us``, ``bytes_moved`` and ``utilization`` (0-1, or None), and ``run`` (a RunResult,
    removed before printing)."""
    name: str
    fn: Callable[..., dict]
    help: str
    options: tuple = field(default_factory=tuple)


@dataclass(frozen=True)
class Command:
    """A top-level ``ascend-emu NAME``. The core adds --json and --quiet to its options, and --profile (loaded into
    ``args.profile``, a HardwareProfile) when ``profile`` is set: the command runs the emulator."""
    name: str
    help: str
    add_arguments: Callable    # (argparse.ArgumentParser) -> None
    run: Callable              # (argparse.Namespace) -> int exit code
    profile: bool = False


@dataclass(frozen=True)
class DemoStage:
    """A part of ``ascend-emu demo`` from a layer above: ``run(out_dir, quiet, profile) -> dict`` of JSON fields
    (merged into the demo's object) plus ``"ok"`` (bool) and ``"report"`` (callable(console) printing the human
    summary), both removed before printing."""
    name: str
    run: Callable


REGISTRY: dict[str, ModelOp] = {}
COMMANDS: dict[str, Command] = {}
DEMO_STAGES: dict[str, DemoStage] = {}


def register(name: str, help: str, options: tuple = ()):
    """Decorator: ``@register("copy", "GM -> UB -> GM copy", (Option("--bytes", int, 1 << 20, "bytes", min=1),))``."""
    def wrap(fn):
        if name in REGISTRY:
            raise ValueError(f"model op {name!r} registered twice")
        REGISTRY[name] = ModelOp(name, fn, help, tuple(options))
        return fn
    return wrap


def command(name: str, help: str, add_arguments: Callable, *, profile: bool = False):
    """Decorator registering ``ascend-emu NAME``: ``@command("eplb", "...", add_args)`` on ``run(args) -> int``."""
    def wrap(fn):
        if name in COMMANDS or name in ("demo", "model"):
            raise ValueError(f"command {name!r} registered twice")
        COMMANDS[name] = Command(name, help, add_arguments, fn, profile)
        return fn
    return wrap


def demo_stage(name: str):
    """Decorator registering a demo stage: ``@demo_stage("serving")`` on ``run(out_dir, quiet, profile) -> dict``."""
    def wrap(fn):
        if name in DEMO_STAGES:
            raise ValueError(f"demo stage {name!r} registered twice")
        DEMO_STAGES[name] = DemoStage(name, fn)
        return fn
    return wrap


def command_modules() -> dict[str, str]:
    """Entry name -> module of every registered command module: the installed distributions' entry points in
    ``ascend_emu.cli``, plus the ones this source tree's pyproject.toml declares when the package runs from a source
    tree (PYTHONPATH or an editable install), whose installed metadata may be missing or older than the tree."""
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    try:
        project = tomllib.loads((SOURCE_TREE / "pyproject.toml").read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return found
    if project.get("name") == "ascend-emu":
        found.update(project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {}))
    return found


_loaded: set = set()


def load_command_modules() -> None:
    """Import each command module once. One that fails to import costs its own commands only: a line on stderr."""
    for name, value in sorted(command_modules().items()):
        module = value.split(":")[0].strip()
        if module in _loaded:
            continue
        _loaded.add(module)
        try:
            importlib.import_module(module)
        except Exception as e:  # an absent or broken layer must not take the core's commands down
            print(f"ascend-emu: the commands of {name!r} ({module}) are unavailable: {type(e).__name__}: {e}"
                  f"{_shadowed(module)}", file=sys.stderr)


def _shadowed(module: str) -> str:
    """What to add to a command module's import failure when another installed distribution ships its top-level
    package (Hugging Face's ``kernels``, which transformers 5.25 and newer require, ships a top-level ``kernels``):
    whichever comes first on the import path hides the other."""
    top = module.split(".")[0]
    others = sorted(set(importlib.metadata.packages_distributions().get(top, ())) - {"ascend-emu", "ascend_emu"})
    if not others:
        return ""
    return (f" (the installed distribution {', '.join(others)} also ships a top-level '{top}' package, which hides "
            f"ascend-emu's: uninstall it, or install ascend-emu in an environment without it)")


# -------------------------------------------------------------------------------------- options and their limits
class OptionError(ArgumentError):
    """A command-line option outside what the run allows; ``option`` names it ("--cores")."""

    def __init__(self, message: str, option: str | None = None):
        super().__init__(message)
        self.option = option


def bounded(kind: type = int, min: float | None = None, max: float | None = None):
    """An argparse ``type``: parse ``kind`` and reject values below ``min`` or above ``max`` (and non-finite
    floats), so that the error names the option and the limit."""
    def parse(text: str):
        value = kind(text)              # a ValueError here: argparse says "invalid int value: 'x'"
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if min is not None and value < min:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum {min}")
        if max is not None and value > max:
            raise argparse.ArgumentTypeError(f"{value} is above the maximum {max}")
        return value
    parse.__name__ = kind.__name__
    return parse


def pod_profile(profile, dies: int = 1, option: str | None = None, why: str | None = None):
    """``profile`` (a HardwareProfile, preset name or file; default cloudmatrix384) cut to its first ``dies`` dies.
    An OptionError naming ``option`` when the profile's pod has fewer: ``why`` says what asks for them."""
    from .profile import load_profile
    try:
        return load_profile(profile, dies)
    except ArgumentError as e:
        if option is None:
            raise
        raise OptionError(f"{option}: {why or dies} needs a pod of {dies} dies ({e})", option) from None


def _profile_option(spec):
    from .profile import load_profile
    try:
        return load_profile(spec)
    except ArgumentError as e:
        raise OptionError(f"--profile: {e}", "--profile") from None


def _check_profile_limits(op: ModelOp, opts: dict, profile) -> None:
    for o in op.options:
        if isinstance(o.max, str) and opts[o.dest] > getattr(profile, o.max):
            raise OptionError(f"{o.name}: {opts[o.dest]} is above the maximum {getattr(profile, o.max)} ({o.max} of "
                              f"profile {profile.name!r})", o.name)


def _option_of(exc: BaseException, args) -> str | None:
    """The option a failure is about: an OptionError's own; the option whose value is the file an OSError names; the
    option whose parameter starts a library message ("dies=3: ..." -> --dies; a command maps the library's other
    names of its options with ``parser.set_defaults(_aliases={"num_gpus": "--dies"})``)."""
    if isinstance(exc, OptionError):
        return exc.option
    options = getattr(args, "_options", {})
    if isinstance(exc, OSError) and exc.filename is not None:
        for dest, name in options.items():
            if getattr(args, dest, None) is not None and str(getattr(args, dest)) == str(exc.filename):
                return name
    m = re.match(r"\s*(\w+)=", str(exc))
    names = {**options, **getattr(args, "_aliases", {})}      # _aliases: the library's parameter names of options
    return (names.get(m.group(1)) or names.get(m.group(1).lower())) if m else None    # "K=5" is --k


def not_above(option: str, value, limit, what: str) -> None:
    """An OptionError naming ``option`` when ``value`` exceeds ``limit``, which ``what`` names ("the --experts 16")."""
    if value > limit:
        raise OptionError(f"{option}: {value} is above {what}", option)


# ------------------------------------------------------------------------------------------ output and progress
def console(stderr: bool = False):
    """A rich console. Piped, it is as wide as the content (unless COLUMNS says otherwise): tables keep every column.
    A closed pipe raises BrokenPipeError, which ``main`` turns into exit code 141 as for any other output."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:     # rich's own: point stdout at /dev/null and exit 1
            self.quiet = True
            raise BrokenPipeError(32, "Broken pipe")

    stream = sys.stderr if stderr else sys.stdout
    wide = not stream.isatty() and "COLUMNS" not in os.environ
    return _Console(stderr=stderr, width=100_000 if wide else None)


def pipe_table(title: str, run):
    from rich.table import Table
    t = Table(title=title)
    t.add_column("pipe")
    t.add_column("busy us (sum over cores)", justify="right")
    t.add_column("utilisation", justify="right")
    for pipe, us in run.busy_by_pipe().items():
        t.add_row(pipe, f"{us:.3f}", f"{run.utilization.get(pipe, 0.0):.1%}")
    return t


_live = None           # the progress display on screen (the Ctrl-C handler clears it before the process ends)
_modeled_us = None     # the modeled time the last emulator run reached, for the Ctrl-C message


class Progress:
    """What a command updates while it runs: ``update(description=..., advance=1, total=N)``; ``track(items)``."""

    def __init__(self, bar=None, task=None):
        self._bar, self._task = bar, task

    def update(self, description: str | None = None, advance: float | None = None, total: float | None = None):
        if self._bar is not None:
            kw = {"description": description, "advance": advance, "total": total}
            # a new stage shows at once: rich's own refresh (10 per second) can skip a short one entirely
            self._bar.update(self._task, **{k: v for k, v in kw.items() if v is not None},
                             refresh=description is not None)

    def track(self, items, description: str | None = None):
        """Yield ``items``, advancing by one after each; ``description`` shows from the first item on."""
        self.update(description)
        for item in items:
            yield item
            self.update(advance=1)

    def emulator(self, modeled_us: float, instructions: int) -> None:
        """Every 16k events of an emulator run (Pod.on_progress)."""
        global _modeled_us
        _modeled_us = modeled_us
        if self._bar is not None:
            self._bar.update(self._task, run=f"{modeled_us:,.1f} us modeled, {instructions:,} instructions")


@contextlib.contextmanager
def progress(args, description: str, total: float | None = None):
    """A rich progress bar on stderr when it is a terminal (none with --quiet or --json); every pod made meanwhile
    shows its modeled time in it. The emulator calls back even when quiet: that Python call lets a Ctrl-C through
    every 16k events, whatever the kernels run."""
    global _live, _modeled_us
    from . import pod as pod_module
    bar = task = _modeled_us = None
    if not (getattr(args, "quiet", False) or getattr(args, "json", False)) and sys.stderr.isatty():
        from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn
        bar = RichProgress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[run]}"),
                           TimeElapsedColumn(), console=console(stderr=True), transient=True)
        task = bar.add_task(description, total=total, run="")
        bar.start()
    handle = Progress(bar, task)
    previous, pod_module.DEFAULT_PROGRESS = pod_module.DEFAULT_PROGRESS, handle.emulator
    _live = bar
    try:
        yield handle
    finally:
        pod_module.DEFAULT_PROGRESS = previous
        _live = None
        if bar is not None:
            bar.stop()


def _fail(prog: str, exc_type: str, message: str, option: str | None, as_json: bool, prefix_type: bool) -> None:
    """One line on stderr; with --json also {"error": {...}} on stdout (after the line: stdout may be closed)."""
    message = " ".join(str(message).split())
    where = f"{option}: " if option and not message.startswith(option) else ""
    print(f"{prog}: {where}{exc_type + ': ' if prefix_type else ''}{message}", file=sys.stderr, flush=True)
    if as_json:
        print(json.dumps({"error": {"type": exc_type, "message": message, "option": option}}), flush=True)


def _on_interrupt(state: dict):
    """Ctrl-C: clear the progress bar, report, and end the process at once. Unwinding a paper-scale run instead
    (its frames, the collection after the run re-enables gc, interpreter teardown) takes tens of seconds."""
    def handler(signum, frame):
        with contextlib.suppress(Exception):
            if _live is not None:
                _live.stop()
        where = "" if _modeled_us is None else f" at {_modeled_us:,.1f} us modeled"
        with contextlib.suppress(Exception):
            _fail(state["prog"], "KeyboardInterrupt", f"interrupted (Ctrl-C){where}", None, state["json"], False)
        os._exit(130)
    return handler


# ------------------------------------------------------------------------------------------------- the parser
class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors raise OptionError (one line, JSON with --json) instead of printing the usage."""

    def error(self, message):
        option = None
        m = re.match(r"argument ([^:]+): (.*)", message, re.S)
        if m:
            names = m.group(1).split("/")
            option = max(names, key=len) if names[0].startswith("-") else None
            message = f"{option or names[0]}: {m.group(2)}"
        else:
            m = re.search(r"(?:required|unrecognized arguments): (-[\w-]+)", message)
            option = m.group(1) if m else None
        e = OptionError(message, option)
        e.prog = self.prog
        raise e


def _add(p, *names, **kw) -> None:
    with contextlib.suppress(argparse.ArgumentError):     # the command declares it itself
        p.add_argument(*names, **kw)


def _add_common(p, *, profile: bool, trace: bool = False, suppress: bool = False) -> None:
    """--json, --quiet (and --profile, --trace). ``suppress``: set only when given (an op's parser under ``model``,
    which takes them too: ``model --json OP`` and ``model OP --json`` both work)."""
    from .profile import PRESETS
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    _add(p, "--json", action="store_true", default=d(False),
         help='print one JSON object on stdout (on failure: {"error": {"type", "message", "option"}})')
    _add(p, "--quiet", action="store_true", default=d(False), help="no progress bar")
    if profile:
        _add(p, "--profile", default=d(None), metavar="NAME|FILE",
             help=f"hardware profile: a preset ({', '.join(sorted(PRESETS))}) or a .toml file "
                  f"(HardwareProfile.to_toml); default cloudmatrix384")
    if trace:
        _add(p, "--trace", default=d(None), metavar="FILE", help="write the Chrome trace JSON here")


def _add_checking(p, *, suppress: bool = False) -> None:
    """--sanitize and --jitter-seed (demo and model ops: the commands whose pods this module makes)."""
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    _add(p, "--sanitize", action="store_true", default=d(False),
         help="race-check every pod (ascend_emu.sanitizer): list the races found; exit 1 when there are any")
    _add(p, "--jitter-seed", type=bounded(int, 0), default=d(None), metavar="N",
         help="perturb fabric, memory, flag and launch latencies by up to 30%% with this seed (ascend_emu.jitter)")


def add_workers(p, *, suppress: bool = False) -> None:
    """--workers N: the pods the command makes run over up to N local processes (ascend_emu.workers)."""
    _add(p, "--workers", type=bounded(int, 1), default=argparse.SUPPRESS if suppress else 1, metavar="N",
         help="run each pod over up to N local processes, each owning whole chips (a pod of fewer chips: one per "
              "chip); the same results as one process (ascend_emu.workers)")


@contextlib.contextmanager
def spread(args):
    """Pods made inside without ``workers=`` run over --workers processes; yields the list of their runs' worker
    stats. A run that cannot be partitioned yet is an OptionError naming --workers."""
    from .workers import default_workers
    workers = getattr(args, "workers", 1)
    with default_workers(workers) as runs:
        try:
            yield runs
        except NotPartitionableError as e:
            if workers > 1:
                raise OptionError(f"--workers {workers}: {' '.join(str(e).split())}", "--workers") from None
            raise


def add_workers_block(args, result: dict) -> None:
    """With --workers > 1, ``result["workers"]``: --workers, and per partitioned run, per worker: its dies (first,
    last, count), windows, messages sent, wall and CPU time of its window loop and the share spent waiting at
    window ends. The other fields are those of --workers 1."""
    if getattr(args, "workers", 1) <= 1:
        return
    result["workers"] = {"workers": args.workers, "runs": [[{
        "dies": [s["dies"][0], s["dies"][-1], len(s["dies"])], "windows": s["windows"], "messages": s["messages"],
        "run_s": s["run_s"], "cpu_s": s["cpu_s"], "wait_share": s["wait_s"] / max(s["run_s"], 1e-9)}
        for s in stats] for stats in args.worker_runs]}


@contextlib.contextmanager
def checking(args):
    """Pods made inside sanitize (collecting) and jitter as --sanitize / --jitter-seed say; yields the list of their
    sanitizers (``races`` gives what they found)."""
    from .pod import pod_defaults
    with pod_defaults(sanitize="collect" if getattr(args, "sanitize", False) else False,
                      jitter_seed=getattr(args, "jitter_seed", None)) as found:
        yield found


def races(sanitizers) -> list:
    """Every race the sanitizers of a ``checking`` block found."""
    return [r for s in sanitizers for r in s.races]


def report_races(args, result: dict, found: list, con=None) -> bool:
    """With --sanitize: the races into ``result["races"]`` (JSON) and, given a console, printed; True when clean."""
    if not getattr(args, "sanitize", False):
        return True
    result["races"] = [r.to_dict() for r in found]
    if con is not None:
        con.print(f"[bold]sanitizer[/]: {len(found)} race(s)")
        for r in found:     # plain text: "[0:2048]" is no markup
            con.print(f"  {r}", markup=False, highlight=False)
    return not found


def _finish(p, run: Callable) -> None:
    options = {a.dest: max(a.option_strings, key=len) for a in p._actions if a.option_strings and a.dest != "help"}
    p.set_defaults(_run=run, _prog=p.prog, _options=options)


def _option_help(o: Option) -> str:
    limits = [f"min {o.min}"] if o.min is not None else []
    if o.max is not None:
        limits.append(f"max {o.max}" + (" of the profile" if isinstance(o.max, str) else ""))
    return (f"{o.help} (default {o.default}" + "".join(f"; {x}" for x in limits) + ")").replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: the core's commands, every registered model op and command."""
    parser = _Parser(prog="ascend-emu", description="Ascend NPU die emulator")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    d = sub.add_parser("demo", help="worked example kernels, checked against torch, with trace and timeline",
                       description="worked example kernels (and the layers' demo stages), checked against torch")
    d.add_argument("--out", default="ascend-emu-demo", help="directory for the traces and PNGs")
    _add_common(d, profile=True)
    _add_checking(d)
    add_workers(d)
    _finish(d, cmd_demo)
    m = sub.add_parser("model", help="timing-only run of a registered op (model OP --help: its options)",
                       description="timing-only run of a registered op at any scale; no OP: list them")
    m.add_argument("--list", action="store_true", help="the registered ops and their options")
    _add_common(m, profile=True, trace=True)
    _add_checking(m)
    add_workers(m)
    ops = m.add_subparsers(dest="op", metavar="OP", title="ops")
    for name, op in sorted(REGISTRY.items()):
        p = ops.add_parser(name, help=op.help, description=op.help)
        for o in op.options:
            p.add_argument(o.name, type=bounded(o.type, o.min, None if isinstance(o.max, str) else o.max),
                           default=o.default, choices=o.choices, help=_option_help(o))
        _add_common(p, profile=True, trace=True, suppress=True)
        _add_checking(p, suppress=True)
        add_workers(p, suppress=True)
        p.set_defaults(_aliases={o.param: o.name for o in op.options if o.param})
        _finish(p, cmd_model)
    _finish(m, cmd_model)
    for name, cmd in sorted(COMMANDS.items()):
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        _add_common(p, profile=cmd.profile)
        _finish(p, cmd.run)
    return parser


def main(argv=None) -> int:
    """Run the command line; returns the exit code. Without ``argv`` (the ``ascend-emu`` process) Ctrl-C and a
    closed stdout end the process at once, and the objects left at the end are frozen out of the garbage
    collector's exit pass; given ``argv`` (a caller in Python), they raise as usual and the collector is untouched."""
    standalone = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    state = {"prog": "ascend-emu", "json": "--json" in argv}
    previous = None
    if standalone and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:     # nohup, a background job: keep
        with contextlib.suppress(ValueError):              # not the main thread: leave Ctrl-C alone
            previous = signal.signal(signal.SIGINT, _on_interrupt(state))
    try:
        return _run(argv, state)
    except BrokenPipeError:
        if standalone:      # the reader left (| head): silence the final flush too
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        if standalone:
            # the process ends next: the interpreter's final collection would walk every object the run left alive
            # (half a second at paper scale) only to free what the exit frees anyway
            gc.freeze()


def _run(argv: list, state: dict) -> int:
    load_command_modules()
    args = None
    try:
        args, extra = build_parser().parse_known_args(argv)
        state["prog"], state["json"] = args._prog, bool(getattr(args, "json", False))
        if extra:
            raise OptionError(f"unrecognized arguments: {' '.join(extra)}", extra[0] if extra[0][:1] == "-" else None)
        if "profile" in vars(args):
            args.profile = _profile_option(args.profile)
        with spread(args) as args.worker_runs:      # --workers (commands that take it: add_workers)
            return args._run(args)
    except SystemExit as e:                                  # --help
        return e.code if isinstance(e.code, int) else 0
    except BrokenPipeError:
        raise
    except (EmulatorError, ValueError, OSError) as e:        # bad input: the library's errors, files, options
        _fail(getattr(e, "prog", state["prog"]), type(e).__name__, str(e), _option_of(e, args), state["json"],
              not isinstance(e, OptionError))
        return 2
    except Exception as e:
        if os.environ.get("ASCEND_EMU_TRACEBACK"):
            raise
        _fail(state["prog"], type(e).__name__, f"{e} (an internal error; ASCEND_EMU_TRACEBACK=1 shows where)", None,
              state["json"], True)
        return 1


# ------------------------------------------------------------------------------------------- the core's commands
def cmd_demo(args) -> int:
    from . import demo
    from .pod import Pod
    out_dir = args.out
    os.makedirs(out_dir, exist_ok=True)
    t_wall = time.perf_counter()
    die = pod_profile(args.profile, 1)
    with progress(args, "demo", total=4 + len(DEMO_STAGES)) as bar, checking(args) as sanitizers:
        bar.update("quantise 3072 x 1024 bf16 rows on 48 AIVs")
        q = demo.run_quantize(pod=Pod(die))
        bar.update("int8 GEMM 256 x 512 x 512 on 8 AIC + 16 AIV", advance=1)
        g = demo.run_gemm(pod=Pod(die))
        bar.update("writing trace", advance=1)
        # the two runs had separate pods: the GEMM's timeline follows the quantisation's
        merged = q["run"].trace.followed_by(g["run"].trace, int(q["run"].end_us * 1e6), title="ascend-emu demo")
        trace_path = merged.save(os.path.join(out_dir, "demo_trace.json"))
        bar.update("plotting timeline", advance=1)
        png_path = merged.plot(os.path.join(out_dir, "demo_timeline.png"))
        bar.update(advance=1)
        qr, gr = q["run"], g["run"]
        result = {
            "modeled_us": qr.modeled_us + gr.modeled_us,
            "max_abs_err": max(q["max_abs_err"], g["max_abs_err"]),
            "trace_path": os.path.abspath(trace_path),
            "png_path": os.path.abspath(png_path),
            "quantize": {"modeled_us": qr.modeled_us, "kernel_us": qr.kernel_us, "tokens": q["tokens"],
                         "hidden": q["hidden"], "cores": q["cores"], "q_mismatches": q["q_mismatches"],
                         "max_abs_err": q["max_abs_err"], "pipe_busy_us": qr.busy_by_pipe(),
                         "utilization": qr.utilization, "instructions": qr.instructions},
            "gemm": {"modeled_us": gr.modeled_us, "kernel_us": gr.kernel_us, "m": g["m"], "n": g["n"], "k": g["k"],
                     "int32_exact": g["int32_exact"], "max_abs_err": g["max_abs_err"],
                     "cube_utilization": g["cube_utilization"], "pipe_busy_us": gr.busy_by_pipe(),
                     "utilization": gr.utilization, "instructions": gr.instructions},
        }
        stages_ok, reports = True, []
        for stage in DEMO_STAGES.values():            # e.g. the serving loop, end to end (serving.cli)
            bar.update(f"demo stage: {stage.name}")
            fields = stage.run(out_dir, args.quiet or args.json, args.profile)
            stages_ok &= bool(fields.pop("ok", True))
            reports.append(fields.pop("report", None))
            result.update(fields)
            bar.update(advance=1)
    result["wall_s"] = time.perf_counter() - t_wall
    found = races(sanitizers)
    add_workers_block(args, result)
    if args.json:
        clean = report_races(args, result, found)
        print(json.dumps(result, indent=None))
    else:
        con = console()
        con.print(f"[bold]quantise[/] {q['tokens']}x{q['hidden']} bf16 -> int8 on {q['cores']} AIVs: "
                  f"modeled {qr.modeled_us:.2f} us ({qr.kernel_us:.2f} us in the kernel), "
                  f"{q['q_mismatches']} int8 mismatches vs torch, max scale error {q['max_abs_err']:.3g}")
        con.print(pipe_table("quantise: time per pipe", qr))
        con.print(f"[bold]int8 GEMM[/] {g['m']}x{g['n']}x{g['k']} (MIX, AIV dequant epilogue): modeled "
                  f"{gr.modeled_us:.2f} us ({gr.kernel_us:.2f} us in the kernel), int32 exact: "
                  f"{g['int32_exact']}, bf16 max abs err vs torch {g['max_abs_err']:.3g}, "
                  f"cube utilisation {g['cube_utilization']:.1%}")
        con.print(pipe_table("int8 GEMM: time per pipe", gr))
        con.print(f"trace: {result['trace_path']} (Perfetto / chrome://tracing / MindStudio Insight)")
        con.print(f"timeline: {result['png_path']}")
        for report in reports:
            if report is not None:
                report(con)
        clean = report_races(args, result, found, con)
    ok = q["q_mismatches"] == 0 and g["int32_exact"] and result["max_abs_err"] == 0.0 and stages_ok and clean
    return 0 if ok else 1


def cmd_model(args) -> int:
    if args.list or not args.op:
        for name, op in sorted(REGISTRY.items()):
            opts = " ".join(f"{o.name} ({o.default})" for o in op.options)
            print(f"{name:<16} {op.help}\n{'':<16} {opts}")
        return 0
    op = REGISTRY[args.op]
    opts = {o.dest: getattr(args, o.dest) for o in op.options}
    _check_profile_limits(op, opts, args.profile)
    extra = {"trace": bool(args.trace)}
    params = inspect.signature(op.fn).parameters
    if "profile" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        extra["profile"] = args.profile
    elif args.profile != _profile_option(None):
        raise OptionError(f"--profile: op {op.name!r} runs on the default profile only", "--profile")
    t = time.perf_counter()
    with progress(args, f"model {op.name}"), checking(args) as sanitizers:
        res = op.fn(**opts, **extra)
    run = res.pop("run", None)
    res.setdefault("op", op.name)
    res["options"] = opts
    res["wall_s"] = time.perf_counter() - t
    if args.trace and run is not None and run.trace is not None:
        res["trace_path"] = os.path.abspath(run.trace.save(args.trace))
    found = races(sanitizers)
    add_workers_block(args, res)
    if args.json:
        clean = report_races(args, res, found)
        print(json.dumps(res, default=float))
    else:
        con = console()
        util = res["utilization"]
        con.print(f"[bold]{op.name}[/] modeled {res['modeled_us']:.3f} us, {res['bytes_moved']} bytes moved, "
                  f"utilisation {util if util is None else format(util, '.1%')}")
        if run is not None:
            con.print(pipe_table(f"{op.name}: time per pipe", run))
        clean = report_races(args, res, found, con)
    return 0 if clean else 1


# --------------------------------------------------------------------------------------- the emulator's own ops
@register("quantize", "per-row dynamic INT8 quantisation over a die's AIVs (double-buffered)", (
    Option("--tokens", int, 48 * 128, "rows (tokens)", min=1),
    Option("--hidden", int, 7168, "row length (elements, bf16)", min=1),
    Option("--cores", int, 48, "AIV cores", min=1, max="aiv_per_die"),
    Option("--tile-rows", int, 4, "rows per UB tile (2 slots of bf16 in + int8 out must fit the 192 KiB UB)", min=1),
))
def _quantize(tokens, hidden, cores, tile_rows, trace=False, profile=None):
    from .demo import run_quantize
    from .pod import Pod
    r = run_quantize(tokens, hidden, cores, tile_rows, numeric=False, pod=Pod(pod_profile(profile), trace=trace))
    run = r["run"]
    return {"op": "quantize", "modeled_us": run.modeled_us, "kernel_us": run.kernel_us,
            "bytes_moved": run.bytes_moved, "utilization": run.utilization.get("VECTOR", 0.0),
            "hbm_utilization": run.servers.get("hbm0", {}).get("utilization", 0.0),
            "instructions": run.instructions, "run": run}


@register("gemm-int8", "int8 GEMM on AIC tiles with an AIV dequant epilogue (MIX kernel)", (
    Option("--m", int, 1024, "rows of A", min=1),
    Option("--n", int, 1024, "columns of B", min=1),
    Option("--k", int, 1024, "reduction length", min=1),
    Option("--aic", int, 24, "AIC cores (each with its two AIVs)", min=1, max="aic_per_die"),
))
def _gemm(m, n, k, aic, trace=False, profile=None):
    from .demo import run_gemm
    from .pod import Pod
    r = run_gemm(m, n, k, aic, numeric=False, pod=Pod(pod_profile(profile), trace=trace))
    run = r["run"]
    return {"op": "gemm-int8", "modeled_us": run.modeled_us, "kernel_us": run.kernel_us,
            "bytes_moved": run.bytes_moved, "utilization": r["cube_utilization"],
            "instructions": run.instructions, "run": run}


@register("copy", "bandwidth-bound GM -> UB -> GM copy by a die's AIVs, to the same or another die", (
    Option("--bytes", int, 64 << 20, "bytes to copy", min=1),
    Option("--cores", int, 48, "AIV cores", min=1, max="aiv_per_die"),
    Option("--dst-die", int, 0, "destination die (0 = local; 1 = the other die of the chip; 16+ = another server)",
           min=0),
))
def _copy(bytes, cores, dst_die, trace=False, profile=None):
    from .demo import run_copy
    from .pod import Pod
    prof = pod_profile(profile, dst_die + 1, "--dst-die", f"destination die {dst_die}")
    return run_copy(bytes, cores, dst_die, trace=trace, pod=Pod(prof, trace=trace))


if __name__ == "__main__":      # python -m ascend_emu.cli: run the imported module, whose registry the layers fill
    from ascend_emu.cli import main as _main
    sys.exit(_main())
