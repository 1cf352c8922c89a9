"""Watch where threads train at once, and under torch.func transforms: never an exception in
the user's thread; what watch leaves alone is counted (``unmeasured``) and said."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from torch import nn

import ampaudit
from ampaudit.watch.monitor import Monitor


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _train_in_threads(models: list[nn.Module], steps: int, first_seed: int = 0) -> list[BaseException]:
    """Each model trained by its own thread, all at once (thread i draws its batches from seed
    ``first_seed + i``); the exceptions raised in them. No thread ends before all have trained:
    a followed thread that ended hands the watch to the next one that steps, so the steps
    counted would depend on which finished first."""
    errors: list[BaseException] = []
    start, end = (threading.Barrier(len(models), timeout=60) for _ in range(2))  # broken, not hung, if one raises

    def work(i: int) -> None:
        try:
            g = torch.Generator().manual_seed(first_seed + i)
            opt = torch.optim.SGD(models[i].parameters(), lr=0.1)
            start.wait()
            for _ in range(steps):
                models[i](torch.randn(3, 4, generator=g)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        except BaseException as exc:  # what a thread raised, for the test to show
            errors.append(exc)
        finally:
            with contextlib.suppress(threading.BrokenBarrierError):
                end.wait()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_four_threads_training_at_once_under_run_follow_one_and_count_the_others():
    # before watch/threads.py: IndexError / KeyError in watch/arena.py in 3 of 4 threads
    torch.manual_seed(0)
    models = [_mlp() for _ in range(4)]
    start = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
    with Monitor(None) as monitor:  # ampaudit run's watch: every module, every optimizer
        errors = _train_in_threads(models, steps=6)
    assert errors == []
    summary = monitor.summary()
    assert summary["steps"] == 6  # one thread's steps; the others' optimizer steps end none of them
    assert summary["unmeasured"] == {"other-thread": 3 * 6 * 4}  # 3 threads x 6 steps x 4 modules' outputs
    assert summary["layers"]["0"]["forward"]["numel"] == 6 * 3 * 8  # one thread's forwards, whole
    for i, model in enumerate(models):  # and each thread trained as it would unwatched
        plain = _mlp()
        plain.load_state_dict(start[i])
        assert _train_in_threads([plain], steps=6, first_seed=i) == []
        assert all(torch.equal(model.state_dict()[k], plain.state_dict()[k]) for k in plain.state_dict())


def test_an_evaluation_thread_beside_the_training_is_counted_not_recorded():
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    evaluated = []

    def evaluate() -> None:
        with torch.no_grad():
            evaluated.extend(model(torch.ones(2, 4)).sum().item() for _ in range(5))

    with ampaudit.watch(model, optimizer=opt) as monitor:
        evaluator = threading.Thread(target=evaluate)
        for step in range(4):
            model(torch.randn(3, 4)).pow(2).mean().backward()
            if step == 0:  # the training thread is followed from its first forward on
                evaluator.start()
            opt.step()
            opt.zero_grad()
        evaluator.join()
    summary = monitor.summary()
    assert len(evaluated) == 5 and summary["steps"] == 4
    assert summary["layers"]["(model)"]["forward"]["numel"] == 4 * 3 * 2
    assert summary["unmeasured"] == {"other-thread": 5 * 4} and summary["eval_forwards"]["count"] == 0


def test_when_the_followed_thread_ends_the_next_one_that_trains_is_followed():
    torch.manual_seed(0)
    models = [_mlp(), _mlp()]
    with Monitor(None) as monitor:
        for model in models:  # one training thread after the other
            assert _train_in_threads([model], steps=3) == []
    summary = monitor.summary()
    assert summary["steps"] == 6 and summary["unmeasured"] == {}


def _functional(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[dict, torch.Tensor]:
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return (functional_call(model, p, (xi.unsqueeze(0),)) - yi).pow(2).sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return per_sample, vmap(lambda xi: functional_call(model, params, (xi,)))(x)


@pytest.mark.parametrize("global_hooks", [False, True])
def test_torch_func_transforms_over_a_watched_model_are_counted_not_measured(global_hooks):
    # before: "Cannot access data pointer of Tensor that doesn't have storage" (watch/cpu_kernel.py)
    torch.manual_seed(0)
    model = _mlp()
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    expected = _functional(model, x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (Monitor(None) if global_hooks else ampaudit.watch(model, optimizer=opt)) as monitor:
        grads, out = _functional(model, x, y)
        model(x).sum().backward()  # an ordinary step, measured
        opt.step()
    assert torch.equal(out, expected[1])
    assert all(torch.equal(grads[k], expected[0][k]) for k in grads)
    summary = monitor.summary()
    assert summary["unmeasured"] == {"functorch": 2 * 4}  # two transformed forwards, 4 modules' outputs
    assert summary["layers"]["0"]["forward"]["numel"] == 5 * 8  # the ordinary forward alone
    assert summary["steps"] == 1 and summary["first_nonfinite"] is None


def test_a_functional_call_outside_any_transform_is_measured():
    from torch.func import functional_call

    torch.manual_seed(0)
    model = _mlp()
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    with ampaudit.watch(model) as monitor:
        functional_call(model, params, (torch.randn(3, 4),)).sum().backward()
        monitor.step()
    summary = monitor.summary()
    assert summary["unmeasured"] == {} and summary["layers"]["0"]["forward"]["numel"] == 3 * 8
