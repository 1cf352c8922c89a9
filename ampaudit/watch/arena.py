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


class RowArena:
    """Rows on each device a tensor was recorded on; a row is addressed by (device, index)."""

    def __init__(self, chunk: int = 256) -> None:
        self.chunk = chunk
        self._counts: dict[torch.device, list[torch.Tensor]] = {}
        self._extras: dict[torch.device, list[torch.Tensor]] = {}
        self._rows: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # views, made once
        self._used: dict[torch.device, int] = {}

    def take(self, device: torch.device) -> tuple[Handle, torch.Tensor, torch.Tensor]:
        """A zeroed row on ``device``: (handle, counts view, extras view)."""
        used = self._used.get(device, 0)
        rows = self._rows.setdefault(device, [])
        if used == len(rows):
            counts = torch.zeros(self.chunk, LAYOUT.counts, dtype=torch.int64, device=device)
            extras = torch.zeros(self.chunk, LAYOUT.extras, dtype=torch.float32, device=device)  # whatever the default
            self._counts.setdefault(device, []).append(counts)
            self._extras.setdefault(device, []).append(extras)
            rows.extend(zip(counts.unbind(0), extras.unbind(0), strict=True))
        self._used[device] = used + 1
        return (device, used), *rows[used]

    def matrix(self, handles: list[Handle], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows behind ``handles``, in that order, on ``device``: (counts N x LAYOUT.counts
        int64, extras N x LAYOUT.extras float32)."""
        counts, extras, index = self.used(handles, device)
        return counts.index_select(0, index), extras.index_select(0, index)

    def used(self, handles: list[Handle], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every row used this step, each once, on ``device`` - (counts, extras), views of the
        arena where one device has them all - and where each of ``handles`` is among them: a
        step reduces each used row before it picks its events' rows, never copying raw rows."""
        if not handles:
            return (torch.zeros(0, LAYOUT.counts, dtype=torch.int64, device=device),
                    torch.zeros(0, LAYOUT.extras, dtype=torch.float32, device=device), index_tensor([], device))
        counts, extras, offsets, total = [], [], {}, 0
        for dev, used in self._used.items():  # each device's used rows, one after another
            offsets[dev], total = total, total + used
            counts.append(self._used_rows(self._counts[dev], used).to(device))
            extras.append(self._used_rows(self._extras[dev], used).to(device))
        index = index_tensor([offsets[dev] + i for dev, i in handles], device)
        if len(counts) == 1:
            return counts[0], extras[0], index
        return torch.cat(counts), torch.cat(extras), index

    def _used_rows(self, chunks: list[torch.Tensor], used: int) -> torch.Tensor:
        needed = chunks[: -(-used // self.chunk)]
        return (needed[0] if len(needed) == 1 else torch.cat(needed))[:used]

    def reset(self) -> None:
        """Zero the rows used this step, for the next one."""
        for dev, used in self._used.items():
            for i in range(0, used, self.chunk):
                self._counts[dev][i // self.chunk][: used - i].zero_()
                self._extras[dev][i // self.chunk][: used - i].zero_()
        self._used.clear()
