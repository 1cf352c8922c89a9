"""The edges of AMP448 (a GradScaler built per epoch) and AMP449 (its state left out of the
checkpoint) that the fixtures' twins do not isolate: each case is one small script."""

from __future__ import annotations

import textwrap

from ampaudit.check.lint_file import lint_source

STEP = '''
    with torch.autocast("cuda"):
        loss = model(x).sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
'''


def _found(code: str, source: str) -> list[int]:
    return [f.line for f in lint_source("train.py", textwrap.dedent(source)) if f.rule == code]


def test_a_state_dict_copied_onto_the_optimizer_is_no_checkpoint():
    # NVIDIA's LAMB test shape: optimizer.load_state_dict(optimizer.state_dict()), then torch.save elsewhere
    source = "import torch\n\n\ndef run(model, optimizer, scaler, x):\n" + STEP + \
        "    optimizer.load_state_dict(optimizer.state_dict())\n    torch.save(model.state_dict(), 'm.pt')\n"
    assert _found("AMP449", source) == []


def test_a_scaler_handed_to_the_save_helper_counts_as_saved():
    # Swin's save_checkpoint(config, epoch, model, ..., optimizer, lr_scheduler, loss_scaler, logger)
    source = ("import torch\nfrom utils import save_checkpoint\n\n\ndef run(model, optimizer, scaler, x, ckpt):\n"
              + STEP + "    optimizer.load_state_dict(ckpt['optimizer'])\n"
              "    torch.save({'optimizer': optimizer.state_dict()}, 'o.pt')\n"
              "    save_checkpoint(model, optimizer, scaler)\n")
    assert _found("AMP449", source) == []
    assert _found("AMP449", source.replace("    save_checkpoint(model, optimizer, scaler)\n", "")) == [13]


def test_saving_without_restoring_is_not_reported():
    source = ("import torch\n\n\ndef run(model, optimizer, scaler, x):\n" + STEP
              + "    torch.save({'optimizer': optimizer.state_dict()}, 'o.pt')\n")
    assert _found("AMP449", source) == []


def test_a_per_step_function_called_in_the_batch_loop_builds_a_scaler_per_step():
    source = '''\
    import torch


    def train_step(model, optimizer, x):
        scaler = torch.amp.GradScaler("cuda")
        with torch.autocast("cuda"):
            loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


    def train(model, optimizer, loader, epochs):
        for epoch in range(epochs):
            for x in loader:
                train_step(model, optimizer, x)
    '''
    assert _found("AMP448", source) == [5]
    # called once (no loop around the call): one scaler for the run
    assert _found("AMP448", source.replace("            for x in loader:\n                train_step",
                                           "            pass\n        train_step")) == []


def test_a_restore_through_a_helper_handed_the_optimizer_counts_as_restored():
    # yolov5's train.py: smart_resume(ckpt, optimizer, ...) restores it in utils/, torch.save saves it here
    source = ("import torch\nfrom utils import smart_resume\n\n\ndef run(model, optimizer, scaler, x, ckpt):\n"
              "    start = smart_resume(ckpt, optimizer)\n" + STEP
              + "    torch.save({'optimizer': optimizer.state_dict()}, 'o.pt')\n")
    assert _found("AMP449", source) == [13]  # the torch.save line
    # the helper handed the scaler too restores it as well; torch.load(path) restores nothing
    call = "smart_resume(ckpt, optimizer)"
    assert _found("AMP449", source.replace(call, "smart_resume(ckpt, optimizer, scaler)")) == []
    assert _found("AMP449", source.replace(call, "torch.load(ckpt)")) == []
