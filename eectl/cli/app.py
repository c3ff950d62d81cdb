"""The typer app and what every command shares: the common options, the error mapping (domain errors to one line
and an exit code, once; traceback with EECTL_DEBUG=1; click's own usage errors one line too) and the thread set-up.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import signal
import sys
import threading
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core

from eectl import __version__
from eectl.contracts.recipe import COUNTS, MAX_THREADS, Recipe, check_count, pick
from eectl.errors import EectlError, UsageError
from eectl.files import check_path_option, path_problem

# click's base of every error it reports to the user (an unknown option or command, a bad value, a missing
# argument). typer vendors click and names it publicly only from 0.28 on (TyperException); found through the public
# BadParameter, it is the same class in every typer this project allows.
_ClickError: Any = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


@contextlib.contextmanager
def _one_line_usage() -> Iterator[None]:
    """click's own errors as one line on stderr and their exit code (2 for a usage error), like the domain
    errors, instead of typer's boxed usage; a bare `eectl` still prints the help."""
    try:
        yield
    except _ClickError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":
            raise
        lines = (line.strip() for line in exc.format_message().splitlines())
        ctx = getattr(exc, "ctx", None)
        hint = f" ({ctx.command_path} {ctx.help_option_names[0]} for help)" if ctx is not None else ""
        print(f"error: {' '.join(line for line in lines if line)}{hint}", file=sys.stderr)
        raise typer.Exit(exc.exit_code) from None
    except typer.Abort:
        print("error: aborted", file=sys.stderr)
        raise typer.Exit(1) from None


@contextlib.contextmanager
def _in_context(ctx: Any) -> Iterator[None]:
    """An error click raises without a context (an option missing its value) gets the parsing command's, so its
    line points at that command's help too."""
    try:
        yield
    except _ClickError as exc:
        if getattr(exc, "ctx", None) is None:
            exc.ctx = ctx
        raise


def _flags_read_as_flags(params: list[Any]) -> list[Any]:
    """No value column beside a flag: typer shows its type (`<bool>`) for any option without a metavar, the help
    option it adds (`-h, --help`) included, so every flag without one gets an empty metavar."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class _Command(typer.core.TyperCommand):
    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        with _in_context(ctx):
            return super().parse_args(ctx, args)

    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_read_as_flags(super().get_params(ctx))


class _Group(typer.core.TyperGroup):
    """The top-level group, parsing the command line (its own options, then a command's) inside _one_line_usage:
    the console script and CliRunner on `app` print the same one line."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        with _in_context(ctx):
            return super().parse_args(ctx, args)

    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_read_as_flags(super().get_params(ctx))

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        with _one_line_usage():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: Any) -> Any:
        with _one_line_usage():
            return super().invoke(ctx)


app = typer.Typer(
    cls=_Group,
    name="eectl",
    help="Early-exit LLM inference: profile, calibrate, train heads, export to ONNX, run, bench.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


RecipeOpt = Annotated[
    Path | None,
    typer.Option("--recipe", help="Recipe YAML (recipes/*.yaml); options override it.", rich_help_panel="Common"),
]


BudgetNameOpt = Annotated[
    str | None,
    typer.Option(
        "--budget",
        help="quick, standard or thorough: every size at once (tokens, head training, probes, calibration, bench); "
        "wins over the recipe's sizes, not over this command's own options.",
        rich_help_panel="Common",
    ),
]


JsonOpt = Annotated[
    bool,
    typer.Option(
        "--json", help="Print one JSON document on stdout; progress off.", rich_help_panel="Common", metavar=""
    ),
]


ThreadsOpt = Annotated[
    int | None, typer.Option("--threads", "-t", help="CPU threads (default: one per core).", rich_help_panel="Common")
]


MaxRiskOpt = Annotated[
    float | None,
    typer.Option(
        "--max-risk",
        help="The largest certified risk (calibrate --guarantee sequence) a lossy default may carry; 0: lossless "
        "only (default: the certificate's own delta).",
        rich_help_panel="Exits",
    ),
]


ModelArg = Annotated[
    str | None,
    typer.Argument(help="HF model folder, .gguf file, or nothing for the built-in SmolLM2-135M-Instruct."),
]


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, so the clean-up Ctrl-C runs (staging folders, locks, temporaries)
    runs for it too; the command then exits 143 (128 + SIGTERM)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated


# str-typed options that name files too (a model folder, data files, NAME=PATH lists): their names are checked
# like the Path-typed ones (a built-in name is never long enough to be refused)
_PATH_STRINGS = {"artifact", "model", "data", "compare"}


def _path_options(fn: Callable[..., None]) -> dict[str, str]:
    """Parameter name -> how the user spelt it (`--out`, `ARTIFACT`), for every parameter of `fn` that names a file:
    typed Path, or one of _PATH_STRINGS."""
    return _options(fn, lambda name, base: Path in (base, *typing.get_args(base)) or name in _PATH_STRINGS)


def _count_options(fn: Callable[..., None]) -> dict[str, str]:
    """Parameter name -> its spelling, for every int parameter of `fn` named like a count of the recipe schema
    (contracts/recipe.py COUNTS: --steps, --tokens, --prompts, --max-new-tokens, ...): bounded as the recipe is."""
    return _options(fn, lambda name, base: name in COUNTS and int in (base, *typing.get_args(base)))


def _options(fn: Callable[..., None], keep: Callable[[str, Any], bool]) -> dict[str, str]:
    found: dict[str, str] = {}
    for name, hint in typing.get_type_hints(fn, include_extras=True).items():
        if typing.get_origin(hint) is not Annotated:
            continue
        base, *meta = typing.get_args(hint)
        if not keep(name, base):
            continue
        info = next((m for m in meta if isinstance(m, typer.models.ParameterInfo)), None)
        if isinstance(info, typer.models.ArgumentInfo):
            found[name] = name.upper()
        elif isinstance(info, typer.models.OptionInfo):
            given = [info.default] if isinstance(info.default, str) else []  # Option("--out", ...) in Annotated
            decls = [d for d in (*given, *(info.param_decls or ())) if d.startswith("--")]
            found[name] = decls[0] if decls else f"--{name.replace('_', '-')}"
    return found


def _mapped(fn: Callable[..., None]) -> Callable[..., None]:
    """Map domain errors to one line on stderr and the error's exit code (traceback with EECTL_DEBUG=1); SIGTERM
    is handled like SIGINT while the command runs. Every path option's name is checked first (files.
    check_path_option), so a name the file system cannot hold is one line, whatever the command does with it; every
    count option is bounded as the recipe's field of that name is (contracts.recipe.COUNTS)."""
    paths = _path_options(fn)
    counts = _count_options(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        main = threading.current_thread() is threading.main_thread()  # signal handlers live in the main thread
        previous = signal.signal(signal.SIGTERM, _on_sigterm) if main else None
        try:
            for name, option in paths.items():
                check_path_option(kwargs.get(name), option)
            for name, option in counts.items():
                check_count(option, name, kwargs.get(name))
            fn(*args, **kwargs)
        except EectlError as exc:
            if os.environ.get("EECTL_DEBUG"):
                raise
            hint = f" ({exc.hint})" if exc.hint else ""
            print(f"error: {exc.message}{hint}", file=sys.stderr)
            raise typer.Exit(exc.exit_code) from None
        except OSError as exc:
            if exc.errno != errno.ENAMETOOLONG or os.environ.get("EECTL_DEBUG"):
                raise
            # a path from a file rather than an option (a recipe's data:, a --compare list): still one line
            name = str(exc.filename or "")
            why = path_problem(name) or "a name in it is too long"
            print(f"error: cannot use the path '{name[:40]}...': {why} (give a shorter name)", file=sys.stderr)
            raise typer.Exit(UsageError.exit_code) from None
        except Terminated:
            print("terminated", file=sys.stderr)
            raise typer.Exit(143) from None
        except KeyboardInterrupt:
            # Typer turns KeyboardInterrupt into a silent exit 130 before main() could see it: say it here.
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130) from None
        finally:
            if main:
                signal.signal(signal.SIGTERM, previous)

    return wrapper


def command(name: str | None = None) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def register(fn: Callable[..., None]) -> Callable[..., None]:
        app.command(name, cls=_Command)(_mapped(fn))
        return fn

    return register


def _version(value: bool) -> None:
    if value:
        print(f"eectl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show version.", metavar="")
    ] = False,
) -> None:
    """eectl turns a decoder-only LLM checkpoint into an exit-enabled artifact and measures what it buys."""


def set_threads(requested: int | None, recipe: Recipe) -> int:
    """One thread count for torch and ONNX Runtime's global pool (default: one per core), reported by commands."""
    import torch

    from eectl.runtime.ort import init_ort

    n = pick(requested, recipe.threads)
    if n is not None and not 1 <= n <= MAX_THREADS:
        raise UsageError(f"--threads must be in 1..{MAX_THREADS}, got {n}")
    n = init_ort(n)
    torch.set_num_threads(n)
    return n
