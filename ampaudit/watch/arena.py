"""Where a step's raw rows live: preallocated, zeroed device buffers that kernels fill in place.

A row is ``LAYOUT.counts`` int64 counts (the bins, then the count slots: how many values
overflow at the loss scale, how many round to Inf in the audited dtype, how many are -inf)
and ``LAYOUT.extras`` float32 extras (finite absmax, sum of squares): ``layout`` defines
them. Taking a row is a slice - no allocation, no kernel launch - so recording a tensor
costs one kernel launch on a GPU. The buffers grow by chunks and are reused step after
step: the step boundary reads the rows it used and zeroes them (``matrix`` then ``reset``).
"""

from __future__ import annotations

import torch

from ampaudit.watch.layout import LAYOUT

Handle = tuple[torch.device, int]

_INDEXES: dict[tuple, torch.Tensor] = {}  # recently used index tensors, oldest first


def index_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device`` without a host sync. A plain
    ``torch.tensor(values, device="cuda")`` waits for the copy, a sync per step; this copies
    from pinned memory without waiting, and keeps the result: a training loop asks for the
    same indices step after step."""
    key = (tuple(values), device)
    found = _INDEXES.get(key)
    if found is None:
        found = torch.tensor(values, dtype=torch.int64)
        if device.type == "cuda":
            found = found.pin_memory().to(device, non_blocking=True)
        if len(_INDEXES) >= 64:
            del _INDEXES[next(iter(_INDEXES))]
        _INDEXES[key] = found
    return found


class _DeviceRows:
    """One device's rows: the chunks, a (counts, extras) view per row and its two addresses,
    made once per chunk, and how many rows this step used."""

    __slots__ = ("addresses", "counts", "extras", "rows", "used")

    def __init__(self) -> None:
        self.counts: list[torch.Tensor] = []
        self.extras: list[torch.Tensor] = []
        self.rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.addresses: list[tuple[int, int]] = []  # each row's (counts, extras) data pointers
        self.used = 0

    def grow(self, chunk: int, device: torch.device) -> None:
        counts = torch.zeros(chunk, LAYOUT.counts, dtype=torch.int64, device=device)
        extras = torch.zeros(chunk, LAYOUT.extras, dtype=torch.float32, device=device)  # whatever the default
        self.counts.append(counts)
        self.extras.append(extras)
        self.rows.extend(zip(counts.unbind(0), extras.unbind(0), strict=True))
        c, e = counts.data_ptr(), extras.data_ptr()
        c_step, e_step = counts.stride(0) * counts.element_size(), extras.stride(0) * extras.element_size()
        self.addresses.extend((c + i * c_step, e + i * e_step) for i in range(chunk))


_CPU = torch.device("cpu")


class RowArena:
    """Rows on each device a tensor was recorded on; a row is addressed by (device, index)."""

    def __init__(self, chunk: int = 256) -> None:
        self.chunk = chunk
        self._devices: dict[torch.device, _DeviceRows] = {}
        self._cpu: _DeviceRows | None = None  # the CPU's, for ``take_cpu`` without a lookup

    def _rows_on(self, device: torch.device) -> _DeviceRows:
        rows = self._devices.get(device)
        if rows is None:
            rows = self._devices[device] = _DeviceRows()
            if device == _CPU:
                self._cpu = rows
        return rows

    def take(self, device: torch.device) -> tuple[Handle, torch.Tensor, torch.Tensor]:
        """A zeroed row on ``device``: (handle, counts view, extras view)."""
        rows = self._rows_on(device)
        used = rows.used
        if used == len(rows.rows):
            rows.grow(self.chunk, device)
        rows.used = used + 1
        return (device, used), *rows.rows[used]

    def take_cpu(self) -> tuple[Handle, int, int]:
        """A zeroed CPU row by its addresses: (handle, counts address, extras address) - what a
        C kernel writes to, with no tensor made for the row (a hook's hot path)."""
        rows = self._cpu or self._rows_on(_CPU)
        used = rows.used
        if used == len(rows.rows):
            rows.grow(self.chunk, _CPU)
        rows.used = used + 1
        return (_CPU, used), *rows.addresses[used]

    def rows_used(self) -> int:
        """How many rows this step took, on every device."""
        return sum(rows.used for rows in self._devices.values())

    def row(self, handle: Handle) -> tuple[torch.Tensor, torch.Tensor]:
        """The (counts, extras) views of a row taken before."""
        device, index = handle
        return self._devices[device].rows[index]

    def matrix(self, handles: list[Handle], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows behind ``handles``, in that order, on ``device``: (counts N x LAYOUT.counts
        int64, extras N x LAYOUT.extras float32). Only those rows are copied: a step's check of
        each new micro-batch reads that one's rows; gathering every row the step used would make
        a long step's checks quadratic (2000 micro-batches of a hand-made update: 18x python's time)."""
        if not handles:
            return (torch.zeros(0, LAYOUT.counts, dtype=torch.int64, device=device),
                    torch.zeros(0, LAYOUT.extras, dtype=torch.float32, device=device))
        rows = [self._devices[dev].rows[i] for dev, i in handles]
        if any(dev != device for dev, _ in handles):  # rows on several devices (rare): each moved
            rows = [(c.to(device), e.to(device)) for c, e in rows]
        return torch.stack([c for c, _ in rows]), torch.stack([e for _, e in rows])

    def used(self, handles: list[Handle], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every row used this step, each once, on ``device`` - (counts, extras), views of the
        arena where one device has them all - and where each of ``handles`` is among them: a
        step reduces each used row before it picks its events' rows, never copying raw rows."""
        if not handles:
            return (torch.zeros(0, LAYOUT.counts, dtype=torch.int64, device=device),
                    torch.zeros(0, LAYOUT.extras, dtype=torch.float32, device=device), index_tensor([], device))
        counts, extras, offsets, total = [], [], {}, 0
        for dev, rows in self._devices.items():  # each device's used rows, one after another
            if not rows.used:
                continue
            offsets[dev], total = total, total + rows.used
            counts.append(self._used_rows(rows.counts, rows.used).to(device))
            extras.append(self._used_rows(rows.extras, rows.used).to(device))
        index = index_tensor([offsets[dev] + i for dev, i in handles], device)
        if len(counts) == 1:
            return counts[0], extras[0], index
        return torch.cat(counts), torch.cat(extras), index

    def _used_rows(self, chunks: list[torch.Tensor], used: int) -> torch.Tensor:
        needed = chunks[: -(-used // self.chunk)]
        return (needed[0] if len(needed) == 1 else torch.cat(needed))[:used]

    def reset(self) -> None:
        """Zero the rows used this step, for the next one."""
        for rows in self._devices.values():
            used = rows.used
            for i in range(0, used, self.chunk):
                rows.counts[i // self.chunk][: used - i].zero_()
                rows.extras[i // self.chunk][: used - i].zero_()
            rows.used = 0
