"""The step boundary on the device: a logged step's raw rows reduced into one flat float64
buffer (``layout.StepBuffer``). In one process its rows are added to running totals on the
device and only what the step must decide is read back (a log reads the rest of the buffer
for its line); under torch.distributed one ``all_gather`` of it, then one read back.

Every offset and reduction - which columns are summed and which keep their maximum, over a
step's events, over steps and over ranks - comes from ``layout.LAYOUT``. The first
non-finite event is found on the device too: each event's position in the step is its
sequence number, and the buffer keeps the smallest one whose tensor held NaN or Inf.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ampaudit.core.dtypes import LowDtype
from ampaudit.watch import cpu_kernel, stats
from ampaudit.watch.arena import Handle, RowArena, index_tensor
from ampaudit.watch.layout import LAYOUT, MAX, StepBuffer

NO_EVENT = 2**62  # "no non-finite tensor yet" on the device
TOTALS_BATCH = 16  # logged steps summed on the device (``StepReducer._add_to_run``) before the totals
_F64 = torch.float64


@dataclass
class StepValues:
    """One logged step, read back on the host: what ``decode.step_record`` reads."""

    layers: list[list[float]]  # a Stats row per (module, phase); none when the totals stay on the device
    params: list[list[float]] | None  # a Stats row per parameter; None when the totals stay on the device
    param_nonfinite: list[bool]  # per parameter: its gradient held NaN or Inf
    norms: list[float]  # per parameter: its gradient's L2 norm
    scaled: list[float]  # per parameter: how many overflow at the loss scale (-1: no GradScaler)
    first: float  # the first non-finite event's sequence number (>= NO_EVENT: none); ranks: seq * world + rank
    scale: float  # the loss scale this step used (-1: none)
    found_inf: float  # the GradScaler's found-inf flags, summed (-1: none)


IGNORED, HARMFUL, ANY = 0, 1, 2  # an event's mode: never first; first if NaN/+inf; if any non-finite


_NAN, _INF, _NEGINF = (LAYOUT.field[name] for name in ("nan", "inf", "neginf"))
assert _INF == _NAN + 1  # read as one slice (``StepReducer.accumulate``)


def bad_events(rows: torch.Tensor, modes: torch.Tensor | None) -> torch.Tensor:
    """Per event (its Stats row), whether it may be where a NaN was born: NaN or +inf in mode
    HARMFUL (inputs, a module that writes -inf masks), any non-finite in mode ANY (gradients,
    where a -inf is an overflow; forwards of modules not yet known to write masks); never if
    IGNORED. (``stats.nonfinite`` and ``stats.harmful`` read the same from raw rows.)"""
    nonfinite = rows[:, _NAN] + rows[:, _INF]
    if modes is None:
        return nonfinite > 0
    return ((nonfinite - rows[:, _NEGINF] > 0) & (modes >= HARMFUL)) | ((nonfinite > 0) & (modes == ANY))


def _read(flags: torch.Tensor, tail: torch.Tensor, one_copy: bool) -> tuple[list[list[float]], list[float]]:
    """N x 2 counts and a 1-D tail, read back: ``one_copy`` (a GPU's) in one copy, one sync;
    else (the CPU's: no sync to save, and the copy into one tensor would cost more) each as it is."""
    if not one_copy:
        return flags.tolist(), tail.tolist()
    values = torch.cat([flags.reshape(-1), tail]).tolist()
    n = flags.numel()
    return [values[i:i + 2] for i in range(0, n, 2)], values[n:]


class StepReducer:
    """Reduces each logged step on the device; ``world`` processes (torch.distributed)."""

    def __init__(self, world: int = 1) -> None:
        self.world = world
        self._totals: torch.Tensor | None = None  # running Stats rows on the device (no log, one process)
        self._totals_index: dict[tuple, int] = {}  # ("layer", module, phase) or ("param", name) -> row
        self._last_norms: dict[str, float] = {}
        self._scaled_totals: dict[str, int] = {}
        # steps not in the totals yet, all with the same rows (index): their rows summed, their
        # maxima kept (``_add_to_run``), and how many
        self._run: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._run_steps = 0
        self._last_rows: tuple[tuple, torch.Tensor] | None = None  # (keys, their rows), for the next step

    # -- one step -----------------------------------------------------------------------------
    def step_buffer(self, arena: RowArena, event_rows: list[Handle], event_keys: list[int], n_keys: int,
                    param_rows: list[Handle], limits: LowDtype, found_inf: torch.Tensor | None,
                    scale: torch.Tensor | None, modes: list[int] | None = None,
                    sharded: tuple[int, ...] = ()) -> tuple[torch.Tensor, StepBuffer]:
        """Everything this step recorded, reduced on the device into one flat float64 buffer
        laid out as the returned ``StepBuffer``. ``event_keys``: each event's (module, phase)
        row, of ``n_keys`` (-1: an event in no row, seen only as a candidate first non-finite);
        ``param_rows``: one arena row per parameter, in the buffer's order; ``modes``: per
        event, which values make it a candidate first non-finite (``bad_events``)."""
        buf = LAYOUT.step_buffer(n_keys, len(param_rows), sharded)
        handles = event_rows + param_rows
        device = handles[0][0] if handles else torch.device("cpu")
        counts, extras, used = arena.used(handles, device)
        n_events = len(event_rows)
        # every used row compacted once, in place in the arena (int64 bins to float64 Stats
        # rows), then the events' and parameters' rows picked and the layers' summed per key in
        # those narrow rows: counts add up alike before and after compacting
        rows = stats.compact_rows(counts, extras, limits)
        if device.type == "cpu" and cpu_kernel.available() and counts.dtype == torch.int64 \
                and extras.dtype == torch.float32:  # one C loop for the few dozen small torch ops below
            flat = cpu_kernel.step_buffer(
                rows, used, n_events, index_tensor(event_keys, device),
                index_tensor(modes, device) if modes is not None and n_events else None, n_keys, counts, extras,
                scale is not None, buf.size, float(NO_EVENT))
            if scale is None and found_inf is None:  # one fill for both (each op costs more than its work)
                flat[buf.scale:].fill_(-1.0)
            else:
                flat[buf.scale] = scale.to(_F64).reshape(()) if scale is not None else -1.0
                flat[buf.found_inf] = found_inf.to(_F64).reshape(()) if found_inf is not None else -1.0
            return flat, buf
        rows = rows.index_select(0, used)
        parts = []
        if n_events:
            in_rows = [i for i, key in enumerate(event_keys) if key >= 0]
            events = rows[:n_events]
            if len(in_rows) != n_events:
                events = events.index_select(0, index_tensor(in_rows, device))
            index = index_tensor([event_keys[i] for i in in_rows], device)
            summed = torch.zeros(n_keys, LAYOUT.width, device=device, dtype=_F64).index_add_(0, index, events)
            if LAYOUT.max_fields:  # the fields kept as a maximum (absmax), not summed
                columns = index_tensor(list(LAYOUT.max_fields), device)
                peaks = torch.zeros(n_keys, len(columns), device=device, dtype=_F64).scatter_reduce_(
                    0, index[:, None].expand(-1, len(columns)), events.index_select(1, columns), "amax",
                    include_self=False)
                summed.index_copy_(1, columns, peaks)
            parts.append(summed.reshape(-1))
            bad = bad_events(rows[:n_events], index_tensor(modes, device) if modes is not None else None)
            first = torch.where(bad.any(), bad.to(torch.int64).argmax(), NO_EVENT).to(_F64).reshape(1)
        else:
            first = torch.full((1,), float(NO_EVENT), device=device, dtype=_F64)
        if param_rows:
            parts.append(rows[n_events:].reshape(-1))
            params = used[n_events:]
            parts.append(extras[params, LAYOUT.extra["sumsq"]].to(_F64).sqrt())
            parts.append(counts[params, LAYOUT.count["scaled"]].to(_F64) if scale is not None
                         else torch.full((len(param_rows),), -1.0, device=device, dtype=_F64))
        minus_one = torch.full((1,), -1.0, device=device, dtype=_F64)
        tail = [first, scale.to(device, _F64).reshape(1) if scale is not None else minus_one,
                found_inf.to(device, _F64).reshape(1) if found_inf is not None else minus_one]
        flat = torch.cat([*parts, *tail])
        assert flat.numel() == buf.size
        return flat, buf

    def gather(self, flat: torch.Tensor, buf: StepBuffer) -> torch.Tensor:
        """Under torch.distributed: one all_gather of the buffer, reduced as ``buf`` says -
        counts summed, maxima kept, and the first non-finite taken from the earliest rank,
        kept on the device as sequence * world + rank, so that the step still reads back once."""
        if self.world <= 1:
            return flat
        gathered = [torch.empty_like(flat) for _ in range(self.world)]
        dist.all_gather(gathered, flat)
        stacked = torch.stack(gathered)
        out = stacked.sum(0)
        ranks = torch.arange(self.world, device=flat.device, dtype=flat.dtype)[:, None]
        for positions, how in buf.reductions():
            if not positions:
                continue
            index = index_tensor(positions, flat.device)
            column = stacked.index_select(1, index)
            if how == MAX:
                value = column.amax(0)
            elif how == StepBuffer.FIRST:
                value = (column * self.world + ranks).amin(0)
            elif how == StepBuffer.RANK0:
                value = column[0]
            elif how == StepBuffer.ROOT_SUM_SQUARES:
                value = column.pow(2).sum(0).sqrt()
            else:
                raise ValueError(f"unknown reduction {how!r}")
            out.index_copy_(0, index, value)
        return out

    def read(self, flat: torch.Tensor, buf: StepBuffer) -> StepValues:
        """The whole buffer, read back: the one host sync of this step."""
        values = flat.tolist()
        rows = [values[buf.row(i)] for i in range(buf.n_rows + buf.n_params)]
        params = rows[buf.n_rows:]
        nan, inf = LAYOUT.field["nan"], LAYOUT.field["inf"]
        return self._with_tail(values, buf, 0, layers=rows[:buf.n_rows], params=params,
                               param_nonfinite=[bool(row[nan] or row[inf]) for row in params])

    def accumulate(self, flat: torch.Tensor, buf: StepBuffer, keys: list[tuple[str, str]],
                   param_keys: list[str]) -> StepValues:
        """Add this step's Stats rows to running totals on the device (``_add_to_run``); read
        back only the parameters' finiteness, norms and overflow at scale and the step's tail
        (one small sync)."""
        rows = flat[buf.stats].reshape(-1, LAYOUT.width)
        if keys or param_keys:
            self._add_to_run(rows, self._rows_of(keys, param_keys, flat.device))
        flags, tail = _read(rows[len(keys):, _NAN:_INF + 1], flat[buf.tail], flat.device.type != "cpu")
        step = self._with_tail(tail, buf, buf.tail.start, layers=[], params=None,
                               param_nonfinite=[bool(nan or inf) for nan, inf in flags])
        # each parameter's own last norm: with two optimizers a step holds only one's parameters
        self._last_norms.update(zip(param_keys, step.norms, strict=True))
        for name, count in zip(param_keys, step.scaled, strict=True):
            if count >= 0:  # with a GradScaler: gradients overflowing at its current scale
                self._scaled_totals[name] = self._scaled_totals.get(name, 0) + int(count)
        return step

    def _rows_of(self, keys: list[tuple[str, str]], param_keys: list[str], device: torch.device) -> torch.Tensor:
        """The totals' rows of a step's keys and parameters (a step's keys are the last's, mostly)."""
        cache = (tuple(keys), tuple(param_keys), device)
        if self._last_rows is not None and self._last_rows[0] == cache:
            return self._last_rows[1]
        index = []
        for key in [("layer", *k) for k in keys] + [("param", k) for k in param_keys]:
            index.append(self._totals_index.setdefault(key, len(self._totals_index)))
        self._last_rows = cache, index_tensor(index, device)
        return self._last_rows[1]

    def _add_to_run(self, rows: torch.Tensor, index: torch.Tensor) -> None:
        """A step's rows added to the run of steps before it with the same rows (``index``: the
        totals' rows of its keys; a training loop's steps have the same): summed, and the
        maxima kept, in place - two ops a step, and no step's rows kept. The run goes into the
        totals when the rows change, after ``TOTALS_BATCH`` steps, and when they are read.
        Counts are whole numbers below 2**53 in float64: any order of adding gives the same sums."""
        columns = index_tensor(list(LAYOUT.max_fields), rows.device)
        run = self._run
        if run is not None and run[0] is index:
            run[1].add_(rows)  # the maxima's columns too: replaced by the maxima when the run ends
            torch.maximum(run[2], rows.index_select(1, columns), out=run[2])
            self._run_steps += 1
        else:
            self._add_pending()
            self._run, self._run_steps = (index, rows.clone(), rows.index_select(1, columns)), 1
        if self._run_steps >= TOTALS_BATCH:
            self._add_pending()

    def _add_pending(self) -> None:
        """The run's rows added to the totals: counts summed, absmax the largest."""
        if self._run is None:
            return
        index, rows, run_peaks = self._run
        self._run = None
        width = LAYOUT.width
        grow = len(self._totals_index) - (0 if self._totals is None else self._totals.shape[0])
        if grow:
            pad = torch.zeros(grow, width, dtype=_F64, device=rows.device)
            self._totals = pad if self._totals is None else torch.cat([self._totals, pad])
        columns = index_tensor(list(LAYOUT.max_fields), rows.device)  # absmax: the largest, not the sum
        peaks = self._totals.index_select(1, columns).scatter_reduce_(
            0, index[:, None].expand(-1, len(columns)), run_peaks, "amax")
        self._totals.index_add_(0, index, rows)
        self._totals.index_copy_(1, columns, peaks)

    @staticmethod
    def _with_tail(values: list[float], buf: StepBuffer, base: int, **rows) -> StepValues:
        """StepValues from ``values``, which hold the buffer's tail at ``buf`` positions - ``base``."""
        def at(part: slice) -> list[float]:
            return values[part.start - base: part.stop - base]

        return StepValues(**rows, norms=at(buf.norms), scaled=at(buf.scaled), first=values[buf.first - base],
                          scale=values[buf.scale - base], found_inf=values[buf.found_inf - base])

    # -- the run -------------------------------------------------------------------------------
    def totals(self) -> tuple[dict[str, dict], dict[str, dict]] | None:
        """The running totals kept on the device, read back (one sync): (layers, params) as
        the summary has them; None when every step was read back instead."""
        self._add_pending()
        if self._totals is None:
            return None
        rows = self._totals.tolist()
        layers: dict[str, dict] = {}
        params: dict[str, dict] = {}
        for key, i in self._totals_index.items():
            entry = stats.to_stats(rows[i])
            if key[0] == "layer":
                layers.setdefault(key[1], {})[key[2]] = entry
            else:
                entry["norm"] = self._last_norms.get(key[1])
                if key[1] in self._scaled_totals:
                    entry["overflow_at_scale"] = self._scaled_totals[key[1]]
                params[key[1]] = entry
        return layers, params
