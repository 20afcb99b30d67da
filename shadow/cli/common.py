"""What every command shares: option types and the checks behind them, user-error handling,
progress, CSV and the final JSON line.

The CLI's contract: bad input is one line on stderr and exit code 2, found before any work (the
options' callbacks below run while the command line is parsed: files, presets, devices, ranges),
so nothing is loaded, created or changed; anything else unexpected is one line and exit code 3
(the traceback under `shadow --debug` or SHADOW_DEBUG); 1 means only "the check failed"; 130 is
Ctrl-C.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Callable, NoReturn

import typer
from rich.markup import escape
from rich.console import Console
from rich.measure import Measurement
from rich.progress import Progress
from rich.table import Table
from typer.core import TyperGroup

from shadow.errors import ShadowInputError

if TYPE_CHECKING:
    from shadow.server.settings import SettingOption

try:  # typer carries its own copy of click since 0.2x; before, it used click itself
    from typer._click import exceptions as click_errors
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover - older typer
    from click import exceptions as click_errors
    from click import get_current_context

# a pipe or file gets a wide table rather than rich's default 80 columns
console = Console(highlight=False, width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160)  # piped: wide, unless COLUMNS says
errors = Console(stderr=True, highlight=False, soft_wrap=True)  # one error, one line

EXIT_FAILED = 1  # the check failed: not bit-equal, gate failed, invalid files
EXIT_USAGE = 2  # bad input: one line on stderr, nothing changed
EXIT_INTERNAL = 3  # a bug or an environment failure: one line (the traceback under --debug)

PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".webp", ".eps", ".ps", ".tif", ".tiff")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda", "mps")


def say_error(message: str) -> None:
    """One line on stderr: `error: message`."""
    errors.print(f"[bold red]error:[/] {escape(message)}", markup=True)


def refuse(param: typer.CallbackParam | None, message: str) -> NoReturn:
    """Bad input met while parsing the command line: one line, exit 2, before the command runs."""
    name = (param.opts[0] if param.opts else param.human_readable_name) if param is not None else ""
    say_error(f"{name} {message}".strip())
    raise typer.Exit(EXIT_USAGE)


def _each(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


# ------------------------------------------------------------------------------------------------
# option callbacks: each returns the value unchanged, or refuses it (one line, exit 2)


def bounds(ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
           zero: bool = False, says: str | None = None) -> Callable:
    """A callback: every value (one, or each of a repeated option) a finite number within the
    bounds; None (not given) passes; with `zero`, 0 also passes (an option's "skip"). The refusal
    reads "--opt must be >= 1 (got 0)", or "--opt {says} (got 0)"."""
    parts = [f"{op} {b:g}" for op, b in ((">=", ge), (">", gt), ("<=", le), ("<", lt)) if b is not None]
    rule = says or "must be " + " and ".join(parts) + (" (or 0 to skip)" if zero else "")

    def check(ctx, param, value):
        for v in _each(value):
            if zero and v == 0:
                continue
            try:
                finite = math.isfinite(v)
            except OverflowError:  # an int past any float: out of every bound
                refuse(param, f"{rule} (got a number of {len(str(v))} digits)")
            if not finite or (ge is not None and v < ge) or (gt is not None and v <= gt) \
                    or (le is not None and v > le) or (lt is not None and v >= lt):
                refuse(param, f"{rule} (got {v:g})")
        return value

    return check


def grid_size(ctx, param, value):
    """A grid: a positive multiple of 64 (each of a repeated option); 0 passes where it means "skip"
    (verify-exact --against-grid)."""
    for v in _each(value):
        if v == 0 and param.name == "against_grid":
            continue
        if v <= 0 or v % 64:
            refuse(param, f"must be a positive multiple of 64 (got {v})")
    return value


def model_name(ctx, param, value):
    """A preset or a Qwen3.5 checkpoint folder with a config.json (each of a repeated option). A
    preset's first use is said when its checkpoint is written (after every check, before the wait)."""
    from shadow.model import checkpoint
    from shadow.model.config import PRESETS

    checkpoint.before_writing_preset = _first_use
    for v in _each(value):
        if v in PRESETS:
            continue
        folder = Path(v)
        try:
            is_dir, has_config = folder.is_dir(), (folder / "config.json").is_file()
        except OSError as e:  # a name the file system cannot take (too long, say)
            refuse(param, f"{v[:80]!r}...: no checkpoint folder can be named so ({e.strerror})")
        if not is_dir:
            refuse(param, f"{v!r}: no checkpoint folder or preset of that name (presets: {', '.join(PRESETS)})")
        if not has_config:
            refuse(param, f"{v}: the checkpoint folder has no config.json")
    return value


def _first_use(name: str, folder) -> None:
    errors.print(f"first use of the {name!r} preset: its random-weight checkpoint is written to {folder} (once)",
                 markup=False)


def device_name(ctx, param, value):
    """cpu, cuda, cuda:N or mps, present on this machine."""
    if value is None or value == "cpu":
        return value
    kind, _, index = value.partition(":")
    if kind not in DEVICES or (index and not index.isdigit()) or (index and kind == "cpu"):
        refuse(param, f"{value!r}: not a device (cpu, cuda, cuda:N, mps)")
    import torch

    if kind == "cuda":
        if not torch.cuda.is_available():
            refuse(param, f"{value}: CUDA is not available here (torch {torch.__version__})")
        if index and int(index) >= torch.cuda.device_count():
            refuse(param, f"{value}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if kind == "mps" and not torch.backends.mps.is_available():
        refuse(param, f"{value}: MPS is not available here")
    return value


def dtype_name(ctx, param, value):
    if value is not None and value not in DTYPES:
        refuse(param, f"unknown dtype {value!r} ({', '.join(DTYPES)})")
    return value


def kernels_name(ctx, param, value):
    """A kernel set's name (each of a repeated option); whether it can run is `check_kernels`'s."""
    from shadow.model.runtime import KERNEL_NAMES as names

    for v in _each(value):
        if v not in names:
            refuse(param, f"unknown kernels {v!r} ({', '.join(names)})")
    return value


def check_kernels(kernels: list[str] | str, device: str) -> None:
    """Before loading anything: a fast kernel set needs CUDA and flash-linear-attention."""
    from shadow.model.runtime import fast_available as available

    wanted = [k for k in _each(kernels) if k not in ("auto", "reference")]
    if wanted and not (device.startswith("cuda") and available()):
        raise ShadowInputError(f"--kernels {wanted[0]} needs --device cuda and flash-linear-attention "
                               "(pip install fla-core)")


def input_file(ctx, param, value):
    """An existing, readable regular file (each of a repeated option)."""
    for v in _each(value):
        path = Path(v)
        if path.is_dir():
            refuse(param, f"{path}: is a folder, not a file")
        if not path.is_file():
            refuse(param, f"{path}: no such file")
        if not os.access(path, os.R_OK):
            refuse(param, f"{path}: not readable")
    return value


SEED_MAX = 2**63 - 1  # torch's generators take a signed 64-bit seed
seed_bounds = bounds(ge=0, le=SEED_MAX, says="must be an integer from 0 to 2**63 - 1")


def tokenizer_path(ctx, param, value):
    """A tokenizer: a readable `tokenizer.json` file, or a folder holding a readable one."""
    if value is None:
        return value
    path = Path(value)
    target = path / "tokenizer.json" if path.is_dir() else path
    if not path.exists():
        refuse(param, f"{path}: no such file or folder")
    if not target.is_file():
        refuse(param, f"{path}: the folder has no tokenizer.json")
    if not os.access(target, os.R_OK):
        refuse(param, f"{target}: not readable")
    return value


def readable_path(ctx, param, value):
    """An existing, readable file or folder (a chat template: a .jinja file, a JSON file, or a
    folder holding one; what it holds is checked where it is read)."""
    if value is None:
        return value
    path = Path(value)
    if not path.exists():
        refuse(param, f"{path}: no such file or folder")
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        refuse(param, f"{path}: not readable")
    return value


def input_folder(ctx, param, value):
    if value is not None and not Path(value).is_dir():
        refuse(param, f"{value}: no such folder")
    return value


def output_file(*suffixes: str) -> Callable:
    """A callback for a file the command writes at its end (--csv, --plot, --write-ledger): its
    folder exists and is writable, the path is not a folder, and (for plots) its suffix is one of
    `suffixes`. Checked at parse time, so a bad path fails before the run, not after it."""

    def check(ctx, param, value):
        if value is None:
            return value
        path = Path(value)
        if path.is_dir() or str(value).endswith(os.sep):
            refuse(param, f"{path}: is a folder; give a file name")
        if suffixes and path.suffix.lower() not in suffixes:
            refuse(param, f"{path}: unknown suffix {path.suffix or '(none)'!r} ({', '.join(suffixes)})")
        parent = path.parent
        if not parent.is_dir():
            refuse(param, f"{path}: no folder {parent}")
        if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            refuse(param, f"{path}: not writable")
        return value

    return check


output_path = output_file()
plot_path = output_file(*PLOT_SUFFIXES)


def folder_to_write(ctx, param, value):
    """A folder the command may create (--disk): not a file, and its nearest existing ancestor a
    writable folder."""
    if value is None:
        return value
    path = Path(value)
    if path.exists() and not path.is_dir():
        refuse(param, f"{path}: is a file, not a folder")
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        refuse(param, f"{path}: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK):
        refuse(param, f"{path}: {ancestor} is not writable")
    return value


# ------------------------------------------------------------------------------------------------
# option types shared by the commands

ModelOpt = Annotated[str, typer.Option("--model", "-m", callback=model_name, help="Preset (tiny, qwen3.5-0.8b, qwen3.5-2b, qwen3.5-4b: random weights) or a Qwen3.5 checkpoint folder.")]
GridOpt = Annotated[int, typer.Option(callback=grid_size, help="Grid G: rows per chunk; the state advances only at multiples of G (a positive multiple of 64).")]
DeviceOpt = Annotated[str, typer.Option(callback=device_name, help="torch device: cpu, cuda, cuda:1, mps (checked before anything loads).")]
DtypeOpt = Annotated[str, typer.Option(callback=dtype_name, help="Model dtype: auto (as stored: float32 for tiny, bfloat16 for the other presets), float32, bfloat16.")]
KernelsOpt = Annotated[str, typer.Option(callback=kernels_name, help="Kernels: auto (fast on CUDA when fla is installed, else reference), reference (plain PyTorch), fast = fla-triton (fused steps: merged projections, fla and Triton kernels, Triton chunk attention), fla-fused (the same with SDPA attention), fla (fla's kernels in the plain steps).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="End stdout with one JSON object on its own line.")]
CsvOpt = Annotated[Path | None, typer.Option("--csv", callback=output_path, help="Also write the table as CSV to this file (its folder must exist).")]
PlotOpt = Annotated[Path | None, typer.Option("--plot", callback=plot_path, help=f"Write the figure to this file ({', '.join(s[1:] for s in PLOT_SUFFIXES)}; its folder must exist).")]


# ------------------------------------------------------------------------------------------------
# options generated from the settings tree (`shadow.server.settings.options`): their flags, defaults,
# ranges and help are the settings fields' own

SETTING_CHECKS = {"model": model_name, "grid": grid_size, "device": device_name, "dtype": dtype_name,
                  "kernels": kernels_name, "file": input_file, "path": readable_path, "tokenizer": tokenizer_path}


def setting_range(setting: SettingOption, zero: bool = False) -> Callable:
    """A callback: every value of the option a finite number ("--x must be a finite number") within
    its range (`Option.allowed`, `ge`...; refused as "--x {says} (got 3)"); with `zero`, 0 also
    passes (an option's "none")."""
    o = setting.option
    ranged = bounds(ge=o.ge, gt=o.gt, le=o.le, lt=o.lt, zero=zero, says=o.says) if o.ranged and not o.allowed else None

    def check(ctx, param, value):
        for v in _each(value):
            if isinstance(v, float) and not math.isfinite(v):
                refuse(param, f"must be a finite number (got {v:g})")
            if o.allowed and v not in o.allowed and not (zero and v == 0):
                refuse(param, f"{o.says or 'is one of ' + ', '.join(map(str, o.allowed))} (got {v})")
        return ranged(ctx, param, value) if ranged is not None else value

    return check


def setting_parameter(setting: SettingOption, *, env_prefix: str | None = None, repeat: bool = False,
                      zero: bool = False, note: str = "") -> inspect.Parameter:
    """The keyword parameter Typer reads one generated option from: the setting's flag (a bool:
    `--x/--no-x`; a bool flagged `--no-x`: that flag alone), default, help and panel; checked while parsing by its kind (`SETTING_CHECKS`) and
    range. `env_prefix`: its environment variable is `env_prefix` + the flag in capitals (or the
    option's own `env`); None: none. `repeat`: given several times, its default the one-item list;
    `zero`: 0 also passes the range (the command reads it as "none"); `note`: what the command
    adds to the help."""
    o, flag = setting.option, setting.flag
    switch = setting.type is bool and not flag.startswith("--no-")  # a --no-x flag is one way: it only turns x off
    decls = [f"{flag}/--no-{flag[2:]}" if switch else flag] + ([o.short] if o.short else [])
    checks = [c for c in (SETTING_CHECKS.get(o.check), setting_range(setting, zero) if setting.type is not bool
                          and setting.option.text is None else None) if c is not None]
    env = None if env_prefix is None else o.env or env_prefix + flag[2:].replace("-", "_").upper()
    info = typer.Option(*decls, envvar=env, help=f"{o.help} {note}".strip(), rich_help_panel=o.panel,
                        callback=_chained(checks))
    kind, default = setting.type, setting.default
    if repeat:
        kind, default = list[_plain(kind)], [default]
    return inspect.Parameter(setting.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[kind, info])


def _plain(kind):
    """`T` of `T | None`."""
    args = [a for a in getattr(kind, "__args__", ()) if a is not type(None)]
    return args[0] if len(args) == 1 else kind


def _chained(checks: list[Callable]) -> Callable | None:
    if not checks:
        return None

    def check(ctx, param, value):
        for c in checks:
            value = c(ctx, param, value)
        return value

    return check


def with_options(parameters: list[inspect.Parameter]) -> Callable:
    """A decorator: the command's signature, as Typer reads it, is its own parameters and then
    `parameters` (keyword-only); their values reach it in its `**kwargs`."""

    def wrap(command: Callable) -> Callable:
        own = inspect.signature(command, eval_str=True)
        kept = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        command.__signature__ = own.replace(parameters=kept + list(parameters))
        return command

    return wrap


# ------------------------------------------------------------------------------------------------
# the contract


def debugging() -> bool:
    ctx = get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    return bool(root is not None and isinstance(root.obj, dict) and root.obj.get("debug")) \
        or os.environ.get("SHADOW_DEBUG", "").lower() in ("1", "true", "yes", "on")


def user_errors(fn: Callable) -> Callable:
    """The CLI's contract, in one place: bad input (a ShadowInputError, or a file the user named
    that cannot be read or written) is one clear line on stderr and exit code 2; anything else
    unexpected is one line and exit code 3, with the traceback before it only under `shadow
    --debug` (or SHADOW_DEBUG=1); Ctrl-C exits 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ShadowInputError as e:
            say_error(str(e))
            raise typer.Exit(EXIT_USAGE) from None
        except (typer.Exit, typer.Abort, click_errors.ClickException):
            raise
        except KeyboardInterrupt:
            errors.print("interrupted")
            raise typer.Exit(130) from None
        except OSError as e:
            if debugging():
                traceback.print_exc()
            where = f" {e.filename}" if getattr(e, "filename", None) else ""
            say_error(f"cannot use{where}: {e.strerror or e}")
            raise typer.Exit(EXIT_USAGE) from None
        except Exception as e:  # noqa: BLE001 - the contract: no traceback unless asked for
            if debugging():
                traceback.print_exc()  # and still exit 3: 1 means only "the check failed"
            errors.print(f"[bold red]internal error:[/] {escape(f'{type(e).__name__}: {e}')}"
                         + ("" if debugging() else " (`shadow --debug ...` shows the traceback)"), markup=True)
            raise typer.Exit(EXIT_INTERNAL) from None

    return wrapper


class ShadowGroup(TyperGroup):
    """The app's group (`typer.Typer(cls=ShadowGroup)`): click's own usage errors (an unknown
    option, a value of the wrong type, a missing argument, a callback's BadParameter such as
    serve's --config) are one line on stderr and exit 2, like every other bad input, instead of
    Typer's framed panel."""

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except click_errors.UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # `shadow verify-exact` alone is not an error
                raise
            say_error(e.format_message())
            raise typer.Exit(e.exit_code) from None


def user_text_file(path: Path, read: Callable):
    """`read(path)`, bad content refused as bad input naming the file: not UTF-8 text, JSON
    nested past Python's recursion limit, a number of thousands of digits (Python's int limit),
    JSON the reader did not catch. The collector is paused while it reads (`collection_paused`)."""
    from shadow.engines.jsonlimits import collection_paused

    try:
        with collection_paused():
            return read(path)
    except ShadowInputError:
        raise
    except UnicodeDecodeError:
        raise ShadowInputError(f"{path}: not UTF-8 text") from None
    except RecursionError:
        raise ShadowInputError(f"{path}: nests too deeply to read") from None
    except ValueError as e:
        if isinstance(e, json.JSONDecodeError) or "integer string conversion" in str(e):
            raise ShadowInputError(f"{path}: not readable JSON ({e})") from None
        raise


def template_kwargs(text: str | None) -> dict:
    """--chat-template-kwargs as a JSON object ({} for none); bad input otherwise."""
    from shadow.server.settings import read_template_kwargs

    return read_template_kwargs(text)


def parse_dtype(name: str):
    import torch

    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": None}
    if name not in table:
        raise ShadowInputError(f"unknown dtype {name!r} (float32, bfloat16, float16, auto)")
    return table[name]


def progress(*columns, **options) -> Progress:
    """A transient progress display on stderr; nothing at all when stderr is not a terminal (a
    pipe gets no stray blank lines)."""
    return Progress(*columns, console=errors, transient=True, disable=not errors.is_terminal, **options)


def emit_json(obj: dict) -> None:
    """The last stdout line: one JSON document."""
    sys.stdout.flush()
    print(json.dumps(obj, separators=(",", ":")), flush=True)


def write_csv(path: Path, rows: list[dict]) -> None:
    """The table as CSV (a pandas DataFrame: one row a dict, columns in the first row's order), and
    a line that says where."""
    import pandas as pd

    pd.DataFrame(rows).to_csv(path, index=False)
    wrote(path)


def save_figure(fig, path: Path) -> None:
    """The figure written to `path` and closed, and a line that says where."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    wrote(path)


def wrote(path: Path) -> None:
    """The line every command prints for each file it writes."""
    console.print(f"wrote {path}")


def show(table: Table) -> None:
    """Print `table` so that it reads at the console's width: as it is where it fits; else, with
    few rows, turned on its side (a column per row, a row per field); else as several tables that
    each repeat the first column. Cells are never cut into pieces of a few letters."""
    width = console.width
    if _width(table) <= width:
        console.print(table)
        return
    columns, n = table.columns, table.row_count
    if 0 < n <= 4:
        side = Table(title=table.title, title_justify=table.title_justify)
        side.add_column(columns[0].header, style="bold", no_wrap=True)
        for i in range(n):
            side.add_column(list(columns[0].cells)[i], justify="right", overflow="fold")
        for column in columns[1:]:
            side.add_row(column.header, *list(column.cells))
        if _width(side) <= width:
            console.print(side)
            return
    key, rest = columns[0], columns[1:]
    needs = [_column_width(c) for c in rest]
    budget = width - _column_width(key) - 1
    count = len(_split(needs, budget))
    fair = next(b for b in range(max(needs), budget + 1) if len(_split(needs, b)) <= count) if max(needs) <= budget \
        else budget  # as few tables, each as narrow as it can be
    groups = _split(needs, fair)
    for k, group in enumerate([rest[i] for i in g] for g in groups):
        part = Table(title=table.title if k == 0 else f"{table.title or ''} (continued)".strip(),
                     title_justify=table.title_justify)
        for column in (key, *group):
            part.add_column(column.header, justify=column.justify, style=column.style, no_wrap=column is key)
        cells = [list(c.cells) for c in (key, *group)]
        for i in range(n):
            part.add_row(*[c[i] for c in cells])
        console.print(part)


def _split(needs: list[int], budget: int) -> list[list[int]]:
    """Indices of consecutive columns, in groups whose widths sum to at most `budget` (a column
    wider than that alone)."""
    groups, used = [[]], 0
    for i, need in enumerate(needs):
        if groups[-1] and used + need > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += need
    return groups


def _width(table: Table) -> int:
    return Measurement.get(console, console.options.update(width=10_000), table).maximum


def _column_width(column) -> int:
    """A column's natural width with its padding and rule."""
    options = console.options.update(width=10_000)
    cells = [column.header, *column.cells]
    return max(Measurement.get(console, options, c).maximum for c in cells) + 3
