"""``ampaudit.apply(model, DIR)``: load an export without pickles.

The export holds the plan and the weights, not the model's code: the user builds the model as
usual, and it is converted again by the plan - the same rewrite, with the promotions that
verification chose recorded in the plan, so no example inputs and no search are needed. The
rebuilt plan must match the recorded one op for op (else the model is not the one that was
converted), then the mixed-dtype weights are loaded with safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ampaudit.convert.api import convert_by_plan
from ampaudit.convert.publish import EXPORT_ID, PLAN, WEIGHTS
from ampaudit.core.arguments import require_module
from ampaudit.core.config import Config
from ampaudit.core.errors import UsageError


def apply(model: torch.nn.Module, export: str | Path, *, config: Config | None = None) -> torch.nn.Module:
    """``model`` (built as it was before ``ampaudit convert``) converted by the export in the
    folder ``export`` (or by the ``plan.json`` file itself, without weights), with its weights."""
    require_module(model, "ampaudit.apply")
    path = Path(export)
    plan_file = path / PLAN if path.is_dir() else path
    weights = plan_file.parent / WEIGHTS if path.is_dir() else None
    try:
        data = json.loads(plan_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read the plan {plan_file}: {exc}") from None
    if not isinstance(data, dict) or "summary" not in data or "plan" not in data:
        raise UsageError(f"{plan_file} is not an ampaudit plan")
    if weights is not None:
        _check_one_export(plan_file, data.get(EXPORT_ID), weights)
    model_mp = convert_by_plan(model, data["summary"], data["plan"], config=config)
    _check_same(plan_file, data["plan"], model_mp.plan)
    if weights is not None:
        from safetensors.torch import load_model

        missing, unexpected = load_model(model_mp, str(weights), strict=False)
        # an export made before fx kept non-persistent buffers out of the state_dict holds them
        # (BERT's embeddings.position_ids): the model has them, unsaved, as it should
        unexpected = [k for k in unexpected if k not in _non_persistent(model_mp)]
        if missing or unexpected:
            raise UsageError(f"{weights} does not fit this model: missing {sorted(missing)[:3]}, "
                             f"unexpected {sorted(unexpected)[:3]}")
    return model_mp


def _check_one_export(plan_file: Path, plan_id: object, weights: Path) -> None:
    """An interrupted export can leave one export's plan.json beside another's weights: refuse
    the mix. Exports made before ids were written (neither file has one) load as before."""
    if not weights.is_file():
        raise UsageError(f"{weights}: no weights in the export")
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights), "pt") as fh:  # reads the header only
            weights_id = (fh.metadata() or {}).get(EXPORT_ID)
    except (OSError, SafetensorError) as exc:
        raise UsageError(f"cannot read the weights {weights}: {exc}") from None
    if plan_id is not None and weights_id is not None and plan_id != weights_id:
        raise UsageError(f"{plan_file.parent}: plan.json and weights.safetensors come from two different exports "
                         "(an export was interrupted): export again")


def _check_same(plan_file: Path, recorded: list[dict[str, Any]], rebuilt: list[dict[str, Any]]) -> None:
    def key(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
        return [(str(r.get("node")), str(r.get("compute"))) for r in records]

    if key(recorded) != key(rebuilt):
        for (node, was), (now_node, now) in zip(key(recorded), key(rebuilt), strict=False):
            if (node, was) != (now_node, now):
                raise UsageError(f"{plan_file} was made for another model: its op {node} ran in {was}, this model's "
                                 f"{now_node} in {now}")
        raise UsageError(f"{plan_file} was made for another model: {len(recorded)} ops planned, this model has "
                         f"{len(rebuilt)}")


def _non_persistent(model: torch.nn.Module) -> set[str]:
    return {f"{path}.{name}" if path else name for path, module in model.named_modules()
            for name in module._non_persistent_buffers_set}
