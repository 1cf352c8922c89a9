"""Through the fx backend a converted model's ``state_dict()`` and ``named_parameters()`` come in
the model's own order (docs/convert.md): a GraphModule holds its state in the order its graph
first reads it, with what the forward never reads added at the end. Transformers' GPT-2 and T5
(tiny configs) kept every key but not their order."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import ampaudit  # noqa: E402
from ampaudit.load.loader import load_target  # noqa: E402
from tests.conftest import model  # noqa: E402


@pytest.mark.parametrize("name", ["hf_gpt2.py", "hf_t5.py", "annotated_transformer.py"])
def test_fx_conversion_keeps_the_state_dict_order(name):
    loaded = load_target(model(name))
    model_mp = ampaudit.convert(loaded.model, loaded.inputs, backend="fx", verify=False)
    assert model_mp.summary.backend == "fx"
    assert list(model_mp.state_dict()) == list(loaded.model.state_dict())
    assert [n for n, _ in model_mp.named_parameters()] == [n for n, _ in loaded.model.named_parameters()]
    # ties kept: one tensor under both names, as in the model
    tied = [(n, p) for n, p in loaded.model.named_parameters(remove_duplicate=False)]
    mine = dict(model_mp.named_parameters(remove_duplicate=False))
    assert [n for n, _ in tied] == list(mine)
    groups = {}
    for n, p in tied:
        groups.setdefault(id(p), []).append(n)
    for names in groups.values():
        assert len({id(mine[n]) for n in names}) == 1, names
