"""HF ``transformers.Trainer`` with ``CPUOffloadAdamW`` (a real client, CPU only, a tiny GPT-2 built
from its config: no hub download). The Trainer clips with its default ``max_grad_norm=1.0`` (the
tiny model's gradient norms are above 1, so every step is clipped) and calls ``step()`` /
``zero_grad()`` through accelerate's ``AcceleratedOptimizer``. The loss curve and the final weights
equal the same Trainer run with ``torch.optim.AdamW(fused=True)`` bitwise; ``save_state`` /
``resume_from_checkpoint`` (``torch.save`` of ``state_dict()``, then ``load_state_dict``)
continues bitwise like the uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _client_util import require  # noqa: E402

transformers = require("transformers")

from offload import CPUOffloadAdamW  # noqa: E402

STEPS = 6
VOCAB = 64


class _Tokens(torch.utils.data.Dataset):
    """32 fixed random sequences (seeded per index): no dataset download."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def _model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _optimizer(kind: str, model, **kw):
    if kind == "torch":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    return CPUOffloadAdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **kw)


def _train(kind: str, out: Path, *, steps: int = STEPS, save_steps: int | None = None,
           resume: str | None = None, **kw):
    model = _model()
    opt = _optimizer(kind, model, **kw)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, logging_steps=1,
        report_to=[], use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0,
        disable_tqdm=True, lr_scheduler_type="constant",
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500)
    assert args.max_grad_norm == 1.0  # the default: the Trainer clips
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(),
                                   optimizers=(opt, None))
    trainer.train(resume_from_checkpoint=resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    if hasattr(opt, "close"):
        opt.close()
    return losses, norms, [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def stock(tmp_path_factory: pytest.TempPathFactory, single_threaded_main):
    return _train("torch", tmp_path_factory.mktemp("stock"))


def _assert_same_run(got, want) -> None:
    losses, norms, params = got
    assert losses == want[0] and len(losses) == STEPS
    assert norms == want[1] and all(n > 1.0 for n in norms)  # every step was clipped
    assert all(torch.equal(a, b) for a, b in zip(params, want[2], strict=True))


def test_trainer_matches_stock_adamw_bitwise(stock, tmp_path: Path, single_threaded_main) -> None:
    _assert_same_run(_train("ours", tmp_path), stock)


def test_trainer_overlap_backward_matches_stock_adamw(stock, tmp_path: Path,
                                                      single_threaded_main) -> None:
    _assert_same_run(_train("ours", tmp_path, overlap_backward=True), stock)


def test_save_state_and_resume_continue_bitwise(stock, tmp_path: Path, single_threaded_main) -> None:
    first = _train("ours", tmp_path, save_steps=3)
    _assert_same_run(first, stock)
    checkpoint = tmp_path / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").is_file()
    # The resumed log holds the checkpoint's 3 steps and the 3 it ran.
    _assert_same_run(_train("ours", tmp_path, resume=str(checkpoint)), stock)
