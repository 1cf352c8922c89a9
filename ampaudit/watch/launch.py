"""This process's place in a distributed launch, from the environment the launcher sets
(torch's ``RANK`` and ``WORLD_SIZE``: torchrun, accelerate, Lightning, srun or mpirun with
env:// init) - known before the script brings its process group up, so before ``ampaudit
run`` attaches. Torch-free."""

from __future__ import annotations

import os


def launched() -> tuple[int, int] | None:
    """(rank, world size) of a distributed launch, or None outside one (or where the two do not
    make sense together)."""
    try:
        rank, world = int(os.environ.get("RANK", "")), int(os.environ.get("WORLD_SIZE", ""))
    except ValueError:
        return None
    return (rank, world) if 0 <= rank < world else None
