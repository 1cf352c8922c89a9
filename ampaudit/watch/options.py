"""The options of a watch, defined once: ``ampaudit.watch()`` / ``Monitor``, the trainers'
callbacks, Accelerate's ``watch`` and ``ampaudit run`` all take a :class:`WatchOptions` (or its
fields as keyword arguments), and ``ampaudit run``'s flags are made from its fields.

Each field carries its default and a one-line ``doc``; ``flag`` says how ``ampaudit run`` takes
it (``None``: not on the command line, ``no_flag`` says why). Adding an option is one field
here, its use where the watch is built (``monitor.py``), and its test (tests/test_watch_options.py).

Torch-free: the command line's ``--help`` reads it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampaudit.core.dtypes import LOW_DTYPES, LowDtype
from ampaudit.watch.layout import LAYOUT

# each Linear operand keeps this many float32 amaxes on its device; TransformerEngine's recipes use
# 16 to 1024. 1e9 allocated 4 GB a row and hung the run.
FP8_HISTORY_MAX = 4096
_SAMPLE, _ABOVE = LAYOUT.hist_sample, LAYOUT.hist_sample_above
# the loss probe's kept calls hold at most this many MiB of what the loss code made (``probe_budget``):
# 300 elementwise ops over 64 x 16384 fp32 logits held 1.2 GB past the backward with no bound but the count
PROBE_LOSS_MB = 256

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Flag:
    """How ``ampaudit run`` takes an option. A bool is a switch: ``--NAME``, or ``--no-NAME`` for
    one on by default; any other option takes a value: ``least`` (a whole number at least this, and
    at most ``most``),
    ``choices``, ``path``, or ``repeat`` (each use adds one). ``default``: the command's own,
    where it is not the API's; ``help``: where the field's doc does not read as a flag's."""

    least: int | None = None
    most: int | None = None
    requires: str | None = None  # a switch this option goes with: given without it, a usage error
    choices: tuple[str, ...] | None = None
    path: bool = False
    repeat: bool = False
    metavar: str | None = None
    default: Any = None
    help: str | None = None
    aliases: tuple[str, ...] = ()  # other spellings: one a launcher's own parser passes on (``--log-file``)


def _about(doc: str, flag: Flag | None = None, *, no_flag: str | None = None) -> dict[str, Any]:
    """A field's metadata: its doc, and its flag (a plain one unless given), or why it has none."""
    if no_flag is None and flag is None:
        flag = Flag()
    return {"doc": doc, "flag": flag, "no_flag": no_flag}


@dataclass(frozen=True)
class WatchOptions:
    """How a watch records and reports; see docs/watch.md. Build it with keyword arguments, or
    let the APIs build it from theirs (``resolve``)."""

    log: str | Path | None = field(default=None, metadata=_about(
        "the JSON-lines log to write, one line per recorded step (rank 0 writes it); None: no log",
        # torchrun's parser takes `--log` for an abbreviation of its own --log-dir and --logs-specs,
        # wherever it stands: `torchrun ... -m ampaudit run --log-file FILE` reaches run
        Flag(path=True, default=Path("ampaudit-watch.jsonl"), aliases=("--log-file",), metavar="FILE",
             help="JSON-lines log to write (default: ./ampaudit-watch.jsonl in the folder run starts in; it "
                  "replaces an earlier watch log, never another file); --log-file: the same, under torchrun")))
    every: int = field(default=1, metadata=_about(
        "record every N-th step", Flag(least=1, help="record every N-th step (default 1)")))
    dtype: LowDtype | torch.dtype | str | None = field(default=None, metadata=_about(
        "the low-precision dtype overflow and underflow are counted against; None: the one the run uses",
        Flag(choices=LOW_DTYPES, help="the low-precision dtype to count overflow/underflow against (default: the "
             "one the run uses - autocast's at the first forward, else the model's own, else float16)")))
    stop_on_nonfinite: bool = field(default=False, metadata=_about(
        "raise NonFiniteError at the step boundary on a non-finite value a loss scale cannot fix",
        Flag(help="stop the script (exit 1) at the step boundary on a non-finite value a loss scale cannot fix")))
    inputs: bool = field(default=False, metadata=_about("also record each module's positional inputs"))
    stop_after_skips: int = field(default=10, metadata=_about(
        "with stop_on_nonfinite and a GradScaler: stop after this many skipped steps in a row",
        Flag(least=1, metavar="N", help="with --stop-on-nonfinite and a GradScaler: stop after N skipped steps "
             "in a row (default 10)")))
    eval: bool = field(default=False, metadata=_about(
        'record grad-disabled forwards (phase "eval"), not only count them'))
    provenance: bool = field(default=True, metadata=_about(
        "keep a step's module calls, to replay the one that went non-finite and name its op and line",
        Flag(help="do not keep a step's module calls to replay the one that went non-finite (saves the memory of "
             "their inputs; the report then names the module but not the op)")))
    probe_loss: bool = field(default=False, metadata=_about(
        "record the loop's own torch calls (the loss code, outside every module) on every step from the first, so "
        "that a NaN made there is named with its line even when it never recurs - a run without a GradScaler, "
        "whose weights go NaN after the first bad step; costs each such call some Python; not with torch.compile "
        "(off from the first step that compiled) or across processes",
        Flag(help="record the loop's own torch calls (the loss code) on every step from the first, to name the line "
             "of a NaN made there even when it never recurs (no GradScaler: the weights go NaN after it); costs "
             "each such call some Python")))
    probe_loss_mb: int = field(default=PROBE_LOSS_MB, metadata=_about(
        "the loss probe's memory: the tensors its kept calls made (held until the step's end, past the "
        "backward) in MiB at most; over it, the oldest calls are dropped, and a NaN made by a dropped call is "
        "not named (the note says so)",
        Flag(least=1, metavar="MB", help=f"the loss probe's memory, in MiB (default {PROBE_LOSS_MB}): over it, "
             "its oldest calls are dropped, and a NaN one of them made is not named")))
    ignore: Sequence[str] = field(default=(), metadata=_about(
        "modules (fnmatch on their names, e.g. 'blocks.*.attn.mask') never reported as where a NaN/Inf was born",
        Flag(repeat=True, metavar="PATTERN")))
    guard: bool | Sequence[Any] = field(default=False, metadata=_about(
        "with a GradScaler: True (the optimizer's LR schedulers and torch's AveragedModel EMAs, found), or the LR "
        "schedulers and EMAs to hold, so that a step the scaler skips leaves them and BatchNorm's running "
        "statistics as they were; only those that step once per optimizer step are held",
        Flag(help="hold every LR scheduler and torch AveragedModel that steps once per optimizer step when a "
             "GradScaler skips that step, and put back the running statistics of every BatchNorm that ran in it")))
    inside_compile: bool = field(default=False, metadata=_about(
        "under torch.compile, record the modules inside the compiled graph too (an op in the graph: no graph "
        "break; inductor's results may differ in the last bits)"))
    exact_histograms: bool = field(default=False, metadata=_about(
        f"bin every element of every tensor; by default a CPU tensor over {_ABOVE} elements has its "
        f"magnitude histogram estimated from about {_SAMPLE} of them (every count - NaN, Inf, overflow, underflow, "
        "zero, absmax - stays exact): binning each element cost about as much as reading it",
        Flag(help=f"bin every element of every tensor (default on the CPU: a tensor over {_ABOVE} elements has "
             f"its magnitude histogram estimated from about {_SAMPLE} of them; every count stays exact)")))
    fp8: bool = field(default=False, metadata=_about(
        "float8 statistics of every Linear (torchao's Float8Linear as it runs, nn.Linear as a what-if): per "
        "operand and step its amax, the tensorwise and delayed recipes' scales, the elements they saturate or "
        "flush to zero, the amax's jump (AMP750, AMP751)"))
    fp8_history: int = field(default=16, metadata=_about(
        "with fp8: the delayed recipe's amax history, in steps (TransformerEngine's amax_history_len)",
        Flag(least=1, most=FP8_HISTORY_MAX, metavar="N", requires="fp8",
             help=f"with --fp8: the delayed recipe's amax history, in steps (default 16, at most {FP8_HISTORY_MAX})")))

    def __post_init__(self) -> None:
        every = self.every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a whole number >= 1 (got {every!r})")
        mb = self.probe_loss_mb
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
            raise ValueError(f"probe_loss_mb must be a whole number >= 1 (got {mb!r})")
        history = self.fp8_history
        if isinstance(history, bool) or not isinstance(history, int) or not 1 <= history <= FP8_HISTORY_MAX:
            raise ValueError(f"fp8_history must be a whole number from 1 to {FP8_HISTORY_MAX} (got {history!r})")
        for name in ("stop_on_nonfinite", "inputs", "eval", "provenance", "probe_loss", "inside_compile",
                     "exact_histograms", "fp8"):
            value = getattr(self, name)
            if not isinstance(value, bool):  # fp8="false" is truthy: it turned the recording on
                raise TypeError(f"{name} must be True or False (got {value!r})")
        ignore = self.ignore
        try:
            patterns = tuple(ignore) if not isinstance(ignore, str) else None
        except TypeError:
            patterns = None
        if patterns is None or not all(isinstance(p, str) for p in patterns):
            raise TypeError(f"ignore must be a list of module-name patterns (got {ignore!r})")
        object.__setattr__(self, "ignore", patterns)
        if not isinstance(self.guard, (bool, type(None))):  # a generator is read once, here
            try:
                object.__setattr__(self, "guard", tuple(self.guard))
            except TypeError:
                raise TypeError(f"guard must be True, False or a list of schedulers/averaged models (got "
                                f"{self.guard!r})") from None


NAMES = tuple(f.name for f in fields(WatchOptions))


def resolve(given: WatchOptions | None = None, keywords: Mapping[str, Any] | None = None, *,
            caller: str = "ampaudit.watch()") -> WatchOptions:
    """``given`` (or the defaults) with ``keywords`` set: what every API that watches calls with
    its ``options=`` and ``**options`` arguments. A name that is not an option is a TypeError
    naming ``caller`` and the options there are."""
    keywords = dict(keywords or {})
    unknown = sorted(set(keywords) - set(NAMES))
    if unknown:
        raise TypeError(f"{caller} got {'an unexpected option' if len(unknown) == 1 else 'unexpected options'} "
                        f"{', '.join(map(repr, unknown))}; its options are {', '.join(NAMES)}")
    if given is not None and not isinstance(given, WatchOptions):
        raise TypeError(f"{caller}: options must be a WatchOptions (got {type(given).__name__})")
    return replace(given, **keywords) if given is not None else WatchOptions(**keywords)
