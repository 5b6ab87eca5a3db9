"""mf.fit: training, history, exact resume, and clear errors for bad input."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import assert_same_run
from workers import build, dataset, fit_run, resume_runs

import meshfit as mf


def test_fit_trains_and_writes_history(tmp_path) -> None:
    result = fit_run(
        {
            "model": "mlp",
            "steps": 12,
            "samples": 64,
            "plan": "dp=1",
            "checkpoint_dir": str(tmp_path),
            "checkpoint_every": 4,
        }
    )
    assert result["steps"] == list(range(1, 13))
    assert result["losses"][-1] < result["losses"][0]
    lines = (tmp_path / "history.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 13))
    assert (tmp_path / "latest").read_text().strip() == "step-00000012"
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))
    assert kept == ["step-00000008", "step-00000012"]  # keep_checkpoints=2


def test_fit_with_dp2_matches_one_process() -> None:
    spec = {"model": "gpt", "steps": 6, "samples": 48, "batch": 8}
    ref = fit_run({**spec, "plan": "dp=1"})
    got = mf.launch(fit_run, nproc=2, args=({**spec, "plan": "dp=2"},))
    assert_same_run(got, ref)


@pytest.mark.slow
def test_resume_continues_the_exact_run(tmp_path) -> None:
    """2N steps straight == N steps, stop, resume for N more (dp=2, AdamW, LR schedule,
    dropout: optimizer state, scheduler, data position and RNG all have to come back)."""
    spec = {
        "model": "mlp",
        "samples": 40,
        "batch": 8,
        "plan": "dp=2",
        "lr_scheduler": True,
        "dropout": True,
    }
    straight = mf.launch(fit_run, nproc=2, args=({**spec, "steps": 8},))
    first = mf.launch(
        fit_run, nproc=2, args=({**spec, "steps": 4, "checkpoint_dir": str(tmp_path)},)
    )
    resumed = mf.launch(
        fit_run, nproc=2, args=({**spec, "steps": 8, "checkpoint_dir": str(tmp_path)},)
    )
    assert first["steps"] == [1, 2, 3, 4]
    assert resumed["steps"] == list(range(1, 9))  # history includes the earlier half
    assert resumed["losses"] == straight["losses"]
    for name, value in straight["state"].items():
        assert torch.equal(resumed["state"][name], value), name


@pytest.mark.slow
def test_pipeline_run_resumes_exactly_with_adamw(tmp_path) -> None:
    """pp=2 with AdamW and an LR schedule: 8 steps straight == 4, stop, resume to 8.
    Each pipeline rank holds other parameters; resuming once failed in AdamW.step with
    KeyError 'betas' (the ranks' optimizer param_groups collided in the checkpoint).
    With dropout in every block, and the interrupted run on a busy rank 0 (which chose
    the cut from timings until issue 32: the cut, and with it each stage's dropout
    masks, moved with the load), the runs must still be bit-identical."""
    spec = {
        "model": "gpt4_dropout",
        "samples": 64,
        "batch": 8,
        "plan": "pp=2",
        "optimizer": "adamw",
        "lr_scheduler": True,
    }
    straight = mf.launch(fit_run, nproc=2, args=({**spec, "steps": 8},))
    saved = {**spec, "checkpoint_dir": str(tmp_path), "checkpoint_every": 2, "busy_rank": 0}
    mf.launch(fit_run, nproc=2, args=({**saved, "steps": 4},))
    resumed = mf.launch(fit_run, nproc=2, args=({**saved, "steps": 8},))
    assert resumed["losses"] == straight["losses"]
    for name, value in straight["state"].items():
        assert torch.equal(resumed["state"][name], value), name


@pytest.mark.slow
def test_a_resume_says_when_the_pipeline_cut_changed(tmp_path, capsys) -> None:
    """The cut is recorded in the checkpoint; a resume under another plan says what it
    was (here: from pp=2 on 2 workers to one process, which has none)."""
    spec = {"model": "gpt4", "samples": 32, "batch": 8, "checkpoint_dir": str(tmp_path)}
    mf.launch(fit_run, nproc=2, args=({**spec, "plan": "pp=2", "steps": 2},))
    capsys.readouterr()
    fit_run({**spec, "plan": "dp=1", "steps": 3, "progress": True})
    out = capsys.readouterr().out
    assert "changed: plan dp=1,pp=2 -> dp=1 (resharded), pipeline cut stages from " in out
    assert re.search(r"pipeline cut stages from blocks 0, \d -> none", out), out


def _assert_resumed_exactly(results: list[dict], specs: list[dict]) -> None:
    for spec, result in zip(specs, results, strict=True):
        straight, resumed = result["straight"], result["resumed"]
        assert resumed["losses"] == straight["losses"], spec["plan"]
        for name, value in straight["state"].items():
            assert torch.equal(resumed["state"][name], value), (spec["plan"], name)


RESUME = {"samples": 64, "batch": 8, "steps": 8, "optimizer": "adamw", "lr_scheduler": True}


@pytest.mark.slow
def test_every_form_resumes_exactly_with_adamw(tmp_path) -> None:
    """fsdp=2, tp=2 and fsdp x pp: 8 steps straight == 4, stop, resume to 8 (dp=2 and pp=2
    have their own tests above; kills mid-run: test_faults.py and BENCHMARKS.md)."""
    specs = [
        {**RESUME, "model": "gpt", "plan": "fsdp=2"},
        {**RESUME, "model": "gpt", "plan": "tp=2"},
        {**RESUME, "model": "gpt4", "plan": "tp=2,pp=2"},
        {**RESUME, "model": "gpt4", "plan": "fsdp=2,pp=2"},
    ]
    nproc = [2, 2, 4, 4]
    two = [s for s, n in zip(specs, nproc, strict=True) if n == 2]
    four = [s for s, n in zip(specs, nproc, strict=True) if n == 4]
    dirs = [str(tmp_path / str(i)) for i in range(len(specs))]
    _assert_resumed_exactly(mf.launch(resume_runs, nproc=2, args=(two, dirs[:2])), two)
    _assert_resumed_exactly(mf.launch(resume_runs, nproc=4, args=(four, dirs[2:])), four)


@pytest.mark.slow
def test_a_3d_plan_resumes_exactly_with_adamw(tmp_path) -> None:
    spec = {**RESUME, "model": "gpt4", "plan": "dp=2,tp=2,pp=2"}
    results = mf.launch(resume_runs, nproc=8, args=([spec], [str(tmp_path)]))
    _assert_resumed_exactly(results, [spec])


@pytest.mark.alone  # steps timed against a 1 s period
def test_checkpoints_every_so_long_as_well_as_every_n_steps(tmp_path) -> None:
    import datetime
    import os
    import time

    model, loss_fn = build("mlp")
    slow = lambda step, engine: time.sleep(1.5 if step in (2, 5) else 0.0)  # noqa: E731
    mf.fit(
        model, dataset("mlp", 64), loss_fn=loss_fn, batch_size=8, max_steps=7, progress=False,
        checkpoint_dir=str(tmp_path), checkpoint_every="1s", keep_checkpoints=10,
        callbacks=[slow],
    )  # fmt: skip
    # a callback runs after its step's save check: the time spent after steps 2 and 5 is
    # seen at steps 3 and 6; and the end saves
    saved = sorted(n for n in os.listdir(tmp_path) if n.startswith("step-"))
    assert saved == ["step-00000003", "step-00000006", "step-00000007"], saved
    for bad in ("soon", "0min", -3, 1.5):
        with pytest.raises(mf.MeshfitError, match="checkpoint_every must be"):
            mf.fit(build("mlp")[0], dataset("mlp", 64), loss_fn=loss_fn, batch_size=8,
                   max_steps=1, checkpoint_dir=str(tmp_path / "x"), checkpoint_every=bad)  # fmt: skip
    from meshfit.training.checks import checkpoint_interval

    assert checkpoint_interval(datetime.timedelta(minutes=30)) == (None, 1800.0)
    assert checkpoint_interval("2h") == (None, 7200.0) and checkpoint_interval(50) == (50, None)


def test_resume_with_other_settings_is_refused(tmp_path) -> None:
    fit_run(
        {"model": "mlp", "steps": 2, "batch": 8, "plan": "dp=1", "checkpoint_dir": str(tmp_path)}
    )
    with pytest.raises(mf.MeshfitError, match="batch_size=8 and this run has batch_size=16"):
        fit_run(
            {
                "model": "mlp",
                "steps": 4,
                "batch": 16,
                "plan": "dp=1",
                "checkpoint_dir": str(tmp_path),
            }
        )


def test_resume_with_another_learning_rate_uses_it_and_says_so(tmp_path, capsys) -> None:
    # Loading the optimizer state restored the old learning rate without a word.
    def run(lr: float, steps: int, **extra) -> mf.History:
        model, loss_fn = build("mlp")
        return mf.fit(
            model,
            dataset("mlp", 32),
            loss_fn=loss_fn,
            batch_size=8,
            max_steps=steps,
            checkpoint_dir=str(tmp_path),
            optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9),
            log_every=1,
            **extra,
        )

    run(0.1, 2)
    history = run(0.05, 4)
    assert [r["lr"] for r in history.records] == [0.1, 0.1, 0.05, 0.05]
    out = capsys.readouterr().out
    assert "resumed from" in out and "changed: lr 0.1 -> 0.05" in out
    # the same settings: nothing changed, and it says that too
    run(0.05, 5)
    assert "no setting changed" in capsys.readouterr().out
    # adding an lr_scheduler is refused (DCP failed on the key it adds to the groups)
    step_lr = {"lr_scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)}
    with pytest.raises(mf.MeshfitError, match=r"saved without an lr_scheduler and this engine"):
        run(0.05, 6, **step_lr)
    # under an lr_scheduler, whose state would set the rate again, a change is refused
    tmp_path = tmp_path / "scheduled"
    run(0.05, 2, **step_lr)
    with pytest.raises(
        mf.MeshfitError, match=r"other optimizer settings \(initial_lr 0\.05 -> 0\.01\)"
    ):
        run(0.01, 4, **step_lr)


def test_data_as_people_have_it_trains_the_same_run() -> None:
    # Keras habits: numpy arrays (float64 cast to the float32 default) and lists; a
    # tokenizer's dict of columns. All train the run of the same data as tensors.
    def losses(data, **extra) -> list[float]:
        model, loss_fn = build("mlp", "float32")
        run = mf.fit(
            model, data, loss_fn=loss_fn, batch_size=8, max_steps=3, progress=False, **extra
        )
        return run.losses

    x, y = dataset("mlp", 24)
    x = x.float()
    as_tensors = losses((x, y))
    assert losses((x.double().numpy(), y.numpy())) == as_tensors
    assert losses((x.tolist(), y.tolist())) == as_tensors

    # a dict of columns (inputs) beside the targets, to a model taking keywords
    class Keywords(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = build("mlp", "float32")[0]

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            return self.inner(features)

    model = Keywords()
    run = mf.fit(
        model,
        ({"features": x.numpy()}, y),
        loss_fn=torch.nn.functional.cross_entropy,
        batch_size=8,
        max_steps=3,
        progress=False,
    )
    assert run.losses == as_tensors


def test_validation_split_and_epochs_as_keras_shows_them(capsys) -> None:
    x, y = dataset("mlp", 40)

    def run(**data) -> mf.History:
        model, loss_fn = build("mlp")
        return mf.fit(model, loss_fn=loss_fn, batch_size=8, epochs=2, log_every=2, **data)

    held_out = run(dataset=(x, y), validation_split=0.2)
    out = capsys.readouterr().out
    assert "Epoch 1/2" in out and "Epoch 2/2" in out and "epoch 2/2 | step 8/8" in out
    # evaluated at the end of every epoch (Keras' habit), said at the start and shown
    # in the epoch's line beside its mean training loss
    assert [step for step, _ in held_out.eval_losses] == [4, 8]
    assert "meshfit: evaluating on 8 samples at the end of every epoch" in out
    epoch_1 = sum(held_out.losses[:4]) / 4
    assert f"epoch 1/2: loss {epoch_1:.4f} - eval loss {held_out.eval_losses[0][1]:.4f}" in out
    explicit = run(dataset=(x[:32], y[:32]), eval_dataset=(x[32:], y[32:]))
    assert held_out.losses == explicit.losses  # the last 20%, taken before shuffling
    assert held_out.eval_losses == explicit.eval_losses
    every_3 = run(dataset=(x, y), validation_split=0.2, eval_every=3)  # eval_every wins
    assert [step for step, _ in every_3.eval_losses] == [3, 6, 8]
    with pytest.raises(mf.MeshfitError, match="validation_split must be a fraction"):
        run(dataset=(x, y), validation_split=1.5)


@pytest.mark.parametrize(
    "data, message",
    [
        (([[1.0, 2.0], [3.0]], [0, 1]), r"dataset cannot be one column.*pad them"),
        ((["a b", "c d"], [0, 1]), r"holds <U3 values, not numbers; tokenize text first"),
        (([[0.0] * 8] * 3, [0, 1]), r"one row per sample.*\[2, 3\]"),
        ({"input_ids": [[1, 2]] * 4, "labels": [[1, 2]] * 3}, r"one row per sample.*\[3, 4\]"),
    ],
)
def test_columns_that_cannot_be_samples_are_refused_with_the_fix(data, message) -> None:
    with pytest.raises(mf.MeshfitError, match=message):
        _fit(data)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from ()


def _fit(data, **overrides):
    model, loss_fn = build("mlp")
    kwargs = dict(loss_fn=loss_fn, batch_size=8, max_steps=2, progress=False)
    kwargs.update(overrides)
    return mf.fit(model, data, **kwargs)


@pytest.mark.parametrize(
    "data, overrides, message",
    [
        ((torch.zeros(0, 8), torch.zeros(0, dtype=torch.long)), {}, "dataset is empty"),
        (dataset("mlp", 5), {}, "holds 5 samples, fewer than one global batch of 8"),
        (
            dataset("mlp", 16),
            {"batch_size": 6, "plan": "microbatches=4"},
            "batch of 6 samples does not split over 1 data-parallel rank\\(s\\) x 4 micro-batch",
        ),
        (dataset("mlp", 16), {"max_steps": None}, "either max_steps=N or epochs=N"),
        (dataset("mlp", 16), {"loss_fn": None}, "needs a loss function"),
        (dataset("mlp", 16), {"checkpoint_every": 2}, "checkpoint_every needs checkpoint_dir"),
        ("train.csv", {}, "must be a torch Dataset"),
        (_Stream(), {}, r"dataset \(a stream\) ended before one global batch of 8"),
        (_Stream(), {"max_steps": None, "epochs": 1}, "it has no length to count epochs"),
        (_Stream(), {"num_workers": 2}, "read with num_workers=0"),
    ],
)
def test_bad_input_is_refused_with_the_fix(data, overrides, message) -> None:
    with pytest.raises(mf.MeshfitError, match=message):
        _fit(data, **overrides)


def test_epochs_count_full_batches_only() -> None:
    history = _fit(dataset("mlp", 20), max_steps=None, epochs=3)
    assert len(history) == 3 * (20 // 8)


def test_diverging_loss_stops_with_advice() -> None:
    with pytest.raises(mf.MeshfitError, match="loss became nan"):
        _fit(dataset("mlp", 16), loss_fn=lambda out, y: out.sum() * float("nan"), max_steps=6)


def test_rows_of_columns_with_a_collate_train_as_the_padded_batch() -> None:
    # A Hugging Face dataset's rows: dicts of lists of different lengths, padded by a
    # collate; inputs=/targets= name the columns. Same run as the padded tensors.
    from workers import LM_VOCAB, build_lm

    g = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(16):
        n = int(torch.randint(3, 9, (), generator=g))
        ids = torch.randint(1, LM_VOCAB, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": ids[1:] + [-100], "note": "text"})

    def pad(samples: list[dict]) -> dict:
        width = max(len(s["input_ids"]) for s in samples)
        ids = [s["input_ids"] + [0] * (width - len(s["input_ids"])) for s in samples]
        labels = [s["labels"] + [-100] * (width - len(s["labels"])) for s in samples]
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}

    loss = mf.losses.cross_entropy()

    def run(data, **reading) -> list[float]:
        model = build_lm("seq_lm")
        history = mf.fit(
            model,
            data,
            loss_fn=loss,
            batch_size=16,
            max_steps=2,
            shuffle=False,
            progress=False,
            **reading,
        )
        return history.losses

    padded = pad(rows)
    expected = run((padded["input_ids"], padded["labels"]))
    assert run(rows, collate=pad, inputs="input_ids", targets="labels") == expected
    with pytest.raises(
        mf.MeshfitError, match=r"no column\(s\) \['label'\]; it has \['input_ids', 'labels'\]"
    ):
        run(rows, collate=pad, inputs="input_ids", targets="label")
    with pytest.raises(mf.MeshfitError, match="give inputs= and targets= together"):
        run(rows, collate=pad, inputs="input_ids")


@pytest.mark.slow
def test_a_stream_trains_the_one_process_run_under_dp_and_resumes_exactly(tmp_path) -> None:
    from workers import stream_fit

    ref = stream_fit({"map_style": True})  # the same samples, as a dataset read in order
    assert_same_run(stream_fit({}), ref)
    got = mf.launch(stream_fit, nproc=2, args=({"plan": "dp=2"},))
    assert_same_run(got, ref)
    # stopped after 3 steps, then resumed to 5: the stream skips the 3 batches trained
    stream_fit({"steps": 3, "checkpoint_dir": str(tmp_path)})
    assert_same_run(stream_fit({"steps": 5, "checkpoint_dir": str(tmp_path)}), ref)
