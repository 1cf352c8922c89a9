"""A logged step's log line, written as text straight from the step's buffer: the same bytes
as ``json.dumps(decode.log_record(...))``, the line's definition, at a fraction of the cost
paid at every logged step. Its Stats rows - thousands of counts on a small transformer - are
written by one C loop (``log_text.c``, built by ``core.native`` on first use) between texts
made once per set of keys and parameters (a training loop's steps share one); the few floats
are written by Python's json. Without a compiler, or with
``AMPAUDIT_CPU_KERNEL=0``, the line is ``json.dumps(log_record(...))`` itself.
"""

from __future__ import annotations

import ctypes
import json
from functools import cache
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch

from ampaudit.core import native
from ampaudit.watch.decode import EXPONENTS, MAGNITUDE, MAGNITUDE_COLUMNS, log_record
from ampaudit.watch.layout import LAYOUT, StepBuffer

SOURCE = Path(__file__).with_name("log_text.c")
_IS_MAGNITUDE = (ctypes.c_ubyte * LAYOUT.hist)(*(i in MAGNITUDE for i in range(LAYOUT.hist)))
_ROOM = 1 << 16  # bytes for the rows at first; doubled while a step's do not fit


@cache
def _function() -> ctypes._CFuncPtr | None:
    lib = native.load(SOURCE)
    if lib is None:
        return None
    fn = lib.ampaudit_log_rows  # rows, width, n, order, hist, exponents, magnitude, texts, at, floats, size, out, cap
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    fn.argtypes = [p, i64, i64, p, i32, i32, p, p, p, p, i64, p, i64]
    fn.restype = i64
    return fn


def available() -> bool:
    return _function() is not None


def _offsets(texts: list) -> ctypes.Array:
    """Where each of ``texts`` starts in their concatenation, and where the last ends."""
    at = list(accumulate(map(len, texts), initial=0))
    return (ctypes.c_int64 * len(at))(*at)


class _Shape:
    """The line's fixed text for one step's keys and parameters: ``"layers": {...}, "params":
    {...}`` around the rows, as ``log_record``'s dicts lay them out (a name seen twice keeps
    its first place and its last row), and which row each place holds."""

    def __init__(self, keys: list[tuple[str, str]], param_keys: list[str], n_rows: int) -> None:
        layers: dict[str, dict[str, int]] = {}
        for i, (module, phase) in enumerate(keys[:n_rows + len(param_keys)]):  # log_record zips keys with the rows
            layers.setdefault(module, {})[phase] = i
        params = {name: n_rows + i for i, name in enumerate(param_keys)}
        texts, order, pending = [], [], '"layers": {'
        for m, (module, phases) in enumerate(layers.items()):
            pending += ("}, " if m else "") + json.dumps(module) + ": {"
            for p, (phase, row) in enumerate(phases.items()):
                texts.append(pending + (", " if p else "") + json.dumps(phase) + ": ")
                order.append(row)
                pending = ""
        pending += ("}" if layers else "") + '}, "params": {'
        for p, (name, row) in enumerate(params.items()):
            texts.append(pending + (", " if p else "") + json.dumps(name) + ": ")
            order.append(row)
            pending = ""
        texts.append(pending + "}")
        self.order = order
        self.order_array = (ctypes.c_int64 * max(1, len(order)))(*order)
        self.texts = "".join(texts).encode("ascii")  # json.dumps writes ASCII
        self.text_at = _offsets(texts)
        self.out = ctypes.create_string_buffer(len(self.texts) + _ROOM)


class LogLines:
    """The log lines of a watch's logged steps (``line``), each written as text."""

    def __init__(self) -> None:
        self._last: tuple[list, list, int, _Shape] | None = None

    def line(self, record: dict[str, Any], flat: torch.Tensor, buf: StepBuffer, keys: list[tuple[str, str]],
             param_keys: list[str]) -> str:
        """``json.dumps(log_record(record, flat, buf, keys, param_keys))``: ``record`` holds
        "layers" and "params", in that order and next to each other (``step_record``'s)."""
        fn = _function()
        names = list(record)
        at = names.index("layers") if "layers" in names else -1
        if fn is None or not (0 <= at < len(names) - 1 and names[at + 1] == "params") \
                or "norms" in record or "overflow_at_scale" in record or flat.dtype != torch.float64:
            return json.dumps(log_record(record, flat, buf, keys, param_keys))
        tail = flat[buf.norms.start:buf.scaled.stop].tolist()
        norms, scaled = tail[:buf.n_params], tail[buf.n_params:]
        parts = [json.dumps({k: record[k] for k in names[:at]})[1:-1], self._rows(fn, flat, buf, keys, param_keys),
                 json.dumps({k: record[k] for k in names[at + 2:]})[1:-1],
                 '"norms": ' + json.dumps(dict(zip(param_keys, norms, strict=True)))]
        if any(count >= 0 for count in scaled):  # with a GradScaler
            parts.append('"overflow_at_scale": ' + json.dumps(
                {name: int(count) for name, count in zip(param_keys, scaled, strict=True)}))
        return "{" + ", ".join(part for part in parts if part) + "}"

    def _rows(self, fn: ctypes._CFuncPtr, flat: torch.Tensor, buf: StepBuffer, keys: list[tuple[str, str]],
              param_keys: list[str]) -> str:
        """``"layers": {...}, "params": {...}``, the rows written by the C loop."""
        if len(param_keys) != buf.n_params:
            raise ValueError(f"{len(param_keys)} parameter names for {buf.n_params} rows")
        shape = self._shape(keys, param_keys, buf.n_rows)
        rows = flat[buf.stats].reshape(-1, LAYOUT.width).contiguous()
        magnitudes = rows.index_select(1, MAGNITUDE_COLUMNS).tolist()
        floats = json.dumps([v for i in shape.order for v in magnitudes[i]]).encode("ascii")
        while True:
            written = fn(rows.data_ptr(), LAYOUT.width, len(shape.order), shape.order_array, LAYOUT.hist,
                         EXPONENTS, _IS_MAGNITUDE, shape.texts, shape.text_at, floats, len(floats), shape.out,
                         len(shape.out))
            if written >= 0:
                return ctypes.string_at(shape.out, written).decode("ascii")
            shape.out = ctypes.create_string_buffer(2 * len(shape.out))

    def _shape(self, keys: list[tuple[str, str]], param_keys: list[str], n_rows: int) -> _Shape:
        last = self._last
        if last is None or last[2] != n_rows or last[0] != keys or last[1] != param_keys:
            last = self._last = list(keys), list(param_keys), n_rows, _Shape(keys, param_keys, n_rows)
        return last[3]
