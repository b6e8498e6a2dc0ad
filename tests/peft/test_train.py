"""The offline tasks and the training loop: every method lowers the eval loss of the keyword task."""

from __future__ import annotations

import pytest
import torch

from sinklens.errors import InvalidArgumentError
from sinklens.peft import make_adapter
from sinklens.peft.train import keyword_task, task_loss, train_adapter
from sinklens.testing import tiny_model

pytestmark = pytest.mark.models  # also run under TransformerLens 3.x (tests/test_tl3_compat.py)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", n_layers=2, d_model=32, n_heads=4, d_mlp=64)


def test_keyword_task_labels_follow_the_keyword(model):
    task = keyword_task(model, n_rows=40, seq_len=10, n_eval=8)
    rows = torch.cat([task.eval, task.train])
    labels = rows[:, -1].unique()
    assert len(labels) == 2 and task.loss_mask.tolist() == [False] * 8 + [True]
    for label in labels:  # each label goes with exactly one keyword, which no other row of the other label holds
        body = rows[rows[:, -1] == label, 1:-1]
        other = rows[rows[:, -1] != label, 1:-1]
        shared = set(body[0].tolist()).intersection(*[set(r.tolist()) for r in body])
        assert any(k not in set(other.flatten().tolist()) for k in shared)


@pytest.mark.parametrize("method,kwargs,lr", [("prefix", {"n_prefix": 4}, 3e-2), ("prefix-plus", {}, 3e-2),
                                              ("lora", {"rank": 4}, 1e-2)])
def test_each_method_lowers_the_eval_loss(model, method, kwargs, lr):
    task = keyword_task(model, n_rows=96, seq_len=8)
    result = train_adapter(model, make_adapter(model, method, **kwargs), task, steps=25, lr=lr, batch_size=16)
    assert result.eval_after["loss"] < result.eval_before["loss"] - 0.3, result.summary()
    assert all(p.requires_grad for p in model.parameters())  # the model is given back unfrozen


def test_task_loss_counts_only_masked_targets():
    logits = torch.zeros(1, 3, 4)
    logits[0, 1, 2] = 100.0  # the target of position 1 is certain
    tokens = torch.tensor([[0, 1, 2]])
    assert float(task_loss(logits, tokens, torch.tensor([False, True]))) == pytest.approx(0.0, abs=1e-6)


def test_bad_training_arguments(model):
    task = keyword_task(model, n_rows=24, seq_len=8)
    with pytest.raises(InvalidArgumentError, match="lr"):
        train_adapter(model, make_adapter(model, "lora"), task, steps=1, lr=-1.0)


def test_evaluate_is_the_mean_over_all_eval_rows(model):
    """Batched evaluation equals one pass over every eval row, whatever the batch size."""
    from sinklens.peft.train import evaluate

    task = keyword_task(model, n_rows=40, seq_len=8, n_eval=7)
    with torch.no_grad():
        logits = model(task.eval)
    loss = float(task_loss(logits, task.eval, task.loss_mask))
    accuracy = float((logits[:, -2].argmax(-1) == task.eval[:, -1]).float().mean())
    for batch_size in (3, 16):
        result = evaluate(model, task, batch_size=batch_size)
        assert result["loss"] == pytest.approx(loss, rel=1e-5) and result["accuracy"] == pytest.approx(accuracy)
