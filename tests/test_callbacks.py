"""Keras-style control of fit: callbacks see every record and can stop the run (which
still returns its History and leaves a checkpoint of its last step); the built-ins
EarlyStopping and BestCheckpoint; CSV and TensorBoard loggers."""

from __future__ import annotations

import csv
import os
import time

import pytest
from workers import build, dataset

import meshfit as mf


def _fit(tmp_path, callbacks=(), **extra) -> mf.History:
    model, loss_fn = build("mlp")
    options = {"max_steps": 10, "log_every": 5, "progress": False, **extra}
    return mf.fit(
        model,
        dataset("mlp", 64),
        loss_fn=loss_fn,
        batch_size=8,
        callbacks=callbacks,
        **options,
    )


class Recorder(mf.Callback):
    def __init__(self) -> None:
        self.steps, self.evals, self.logged = [], [], []

    def on_step_end(self, record, engine):
        self.steps.append((record["step"], record["loss"]))

    def on_eval_end(self, record, engine):
        self.evals.append((record["step"], record["eval_loss"]))

    def on_log(self, record, engine):
        self.logged.append(record["step"])


def test_callbacks_see_every_record_and_evaluation(tmp_path) -> None:
    seen = Recorder()
    history = _fit(tmp_path, [seen], eval_dataset=dataset("mlp", 16), eval_every=4)
    # every step's record, though the log reads the device every 5 steps
    assert [s for s, _ in seen.steps] == list(range(1, 11))
    assert [loss for _, loss in seen.steps] == history.losses
    assert seen.evals == history.eval_losses  # steps 4, 8 and the end
    assert seen.logged == list(range(1, 11))
    assert history.stopped is None


def test_early_stopping_stops_returns_the_history_and_keeps_a_checkpoint(tmp_path) -> None:
    # min_delta larger than any change: the loss never counts as improved after step 1
    stop = mf.EarlyStopping(monitor="loss", patience=2, min_delta=100.0)
    history = _fit(tmp_path, [stop], checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=100)
    assert len(history.records) == 3
    assert history.stopped.startswith("early stopping: loss did not improve for 2 checks")
    assert os.path.isdir(tmp_path / "ck" / "step-00000003")  # the run can be picked up


def test_a_callback_watching_an_evaluation_that_never_happens_is_refused(tmp_path, capsys) -> None:
    """EarlyStopping and BestCheckpoint on eval_loss silently never fired: refused at
    start, naming what would make the value exist."""
    evaluation = {"eval_dataset": dataset("mlp", 16)}
    cases = [
        ([mf.EarlyStopping("eval_loss")], {}, r"EarlyStopping watches 'eval_loss', which this "
         r"run never computes: it has no evaluation data; pass eval_dataset=\.\.\."),
        ([mf.BestCheckpoint("eval_acc", path=str(tmp_path / "b"))], evaluation,
         r"BestCheckpoint watches 'eval_acc', which no evaluation computes \(it gives "
         r"eval_loss\); .* metrics=\{'acc': fn\}"),
        ([mf.EarlyStopping("eval_loss")], evaluation, r"evaluates only once, at its end, so "
         r"it could never act during training; pass eval_every=N"),
    ]  # fmt: skip
    for callbacks, extra, message in cases:
        with pytest.raises(mf.MeshfitError, match=message):
            _fit(tmp_path, callbacks, **extra)
    # a max_steps run with evaluation data but no eval_every says when it evaluates
    _fit(tmp_path, [mf.BestCheckpoint(path=str(tmp_path / "best"))], progress=True, **evaluation)
    assert "evaluating on 16 samples at the end of the run (pass eval_every=N" in (
        capsys.readouterr().out
    )


def test_best_checkpoint_keeps_the_best_evaluation(tmp_path) -> None:
    best = mf.BestCheckpoint()  # eval_loss, in <checkpoint_dir>/best
    history = _fit(
        tmp_path,
        [best],
        eval_dataset=dataset("mlp", 16),
        eval_every=2,
        checkpoint_dir=str(tmp_path / "ck"),
    )
    step, value = min(history.eval_losses, key=lambda e: e[1])
    from meshfit.state.checkpoint import read_meta

    meta = read_meta(str(tmp_path / "ck" / "best"))
    assert meta["extra"]["best"] == {"eval_loss": value, "step": step}
    with pytest.raises(mf.MeshfitError, match="BestCheckpoint needs a place"):
        _fit(tmp_path, [mf.BestCheckpoint()], eval_dataset=dataset("mlp", 16))


def test_csv_and_tensorboard_loggers_write_every_record(tmp_path) -> None:
    history = _fit(
        tmp_path,
        loggers=["csv", "tensorboard"],
        log_dir=str(tmp_path / "runs"),
        eval_dataset=dataset("mlp", 16),
        eval_every=5,
    )
    with open(tmp_path / "runs" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 11))
    assert float(rows[4]["eval_loss"]) == history.records[4]["eval_loss"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 11))
    assert [e.step for e in events.Scalars("eval_loss")] == [5, 10]
    assert "lr" in events.Tags()["scalars"]


def test_learning_rate_monitor_records_every_group_as_the_step_trains(tmp_path) -> None:
    # Two groups (weights decayed, biases not) whose rates fall at different paces;
    # each record must hold the rates its step trained with (the scheduler moves them
    # inside the step: read after it, every record showed the next step's rate).
    import torch

    def optimizer(params):
        params = list(params)
        return torch.optim.SGD(
            [
                {"params": [p for p in params if p.ndim > 1], "name": "weights"},
                {"params": [p for p in params if p.ndim == 1], "name": "biases", "lr": 0.2},
            ],
            lr=0.1,
            momentum=0.9,
            weight_decay=0.01,
        )

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 0.5**s, lambda s: 1 / (1 + s)])

    history = _fit(
        tmp_path,
        [mf.LearningRateMonitor(momentum=True)],
        max_steps=4,
        log_every=3,  # records of steps 1-3 made at step 3, when the rates have moved
        optimizer=optimizer,
        lr_scheduler=schedule,
        loggers=["csv", "tensorboard"],
        log_dir=str(tmp_path / "runs"),
    )
    weights = [0.1 * 0.5**s for s in range(4)]
    biases = [0.2 / (1 + s) for s in range(4)]
    records = history.records
    assert [r["lr"] for r in records] == pytest.approx(weights)  # fit's own: group 0
    assert [r["lr/weights"] for r in records] == pytest.approx(weights)
    assert [r["lr/biases"] for r in records] == pytest.approx(biases)
    assert all(r["momentum/weights"] == r["momentum/biases"] == 0.9 for r in records)
    assert "weight_decay/weights" not in records[0]  # not asked for
    with open(tmp_path / "runs" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["lr/biases"]) for r in rows] == pytest.approx(biases)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    assert [e.value for e in events.Scalars("lr/biases")] == pytest.approx(biases)
    assert os.path.getsize(history.plot(str(tmp_path / "lr.png"))) > 1000  # groups' panel


def test_learning_rate_monitor_with_one_group_adds_only_what_is_asked(tmp_path) -> None:
    import torch

    history = _fit(
        tmp_path,
        [mf.LearningRateMonitor(momentum=True, weight_decay=True)],
        max_steps=2,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, betas=(0.8, 0.99)),
    )
    record = history.records[-1]
    assert record["lr"] == 1e-3 and record["momentum"] == 0.8 and record["weight_decay"] == 0.01
    assert not [k for k in record if k.startswith("lr/")]  # one group: "lr" says it


def test_wandb_logger_writes_an_offline_run_with_no_login(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login: offline, no network
    history = _fit(
        tmp_path,
        loggers=["wandb"],
        log_dir=str(tmp_path / "runs"),
        eval_dataset=dataset("mlp", 16),
        eval_every=5,
    )
    runs = list((tmp_path / "runs" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    # run.finish() returns before wandb's service has flushed the file (~0.1 s later
    # under pytest): wait for its closing "exit" record
    for _ in range(300):
        steps, config = _wandb_run(runs[0])
        if "exit" in config:
            break
        time.sleep(0.1)
    assert sorted(steps) == list(range(1, 11))
    assert [steps[s]["loss"] for s in range(1, 11)] == history.losses
    assert [(s, steps[s]["eval_loss"]) for s in (5, 10)] == history.eval_losses
    assert steps[3]["lr"] == history.records[2]["lr"]
    assert config["plan"] == "dp=1" and config["optimizer"] == "AdamW"


def _wandb_run(path) -> tuple[dict[int, dict], dict]:
    """The history (by step) and config (with "exit" once the run closed) of a .wandb
    file: a LevelDB-style log (a 7-byte
    header, 32 KiB blocks of checksum, length, type, data) of wandb's own protobuf
    Records, read with wandb's generated classes."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, part, raw = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        part += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last part
            raw.append(part)
            part = b""
    steps, config = {}, {}
    for chunk in raw:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == "history":
            items = {
                "/".join(i.nested_key) or i.key: json.loads(i.value_json)
                for i in record.history.item
            }
            steps.setdefault(record.history.step.num, {}).update(items)
        if record.WhichOneof("record_type") == "run":
            for item in record.run.config.update:
                config[item.key] = json.loads(item.value_json)
        if record.WhichOneof("record_type") == "exit":
            config["exit"] = record.exit.exit_code
    config = {k: v.get("value", v) if isinstance(v, dict) else v for k, v in config.items()}
    return steps, config


def test_wandb_logger_without_wandb_names_the_extra(tmp_path, monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(mf.MeshfitError, match=r"pip install meshfit\[wandb\]"):
        _fit(tmp_path, loggers=["wandb"], log_dir=str(tmp_path))


def test_bad_loggers_are_refused_with_the_fix(tmp_path) -> None:
    with pytest.raises(mf.MeshfitError, match=r"unknown logger\(s\) \['mlflow'\]"):
        _fit(tmp_path, loggers=["mlflow"], log_dir=str(tmp_path))
    with pytest.raises(mf.MeshfitError, match="loggers need a directory"):
        _fit(tmp_path, loggers=["csv"])


@pytest.mark.slow
def test_curves_plot_from_the_history_and_from_the_run_files(tmp_path) -> None:
    import subprocess
    import sys

    pytest.importorskip("matplotlib")
    history = _fit(
        tmp_path,
        loggers=["csv"],
        log_dir=str(tmp_path / "runs"),
        eval_dataset=dataset("mlp", 16),
        eval_every=5,
        checkpoint_dir=str(tmp_path / "ck"),
        metrics={"acc": mf.metrics.accuracy},
    )
    png = history.plot(str(tmp_path / "h.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    for run in (tmp_path / "runs", tmp_path / "ck"):  # metrics.csv, history.jsonl
        done = subprocess.run(
            [sys.executable, "-m", "meshfit", "plot", str(run)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert os.path.getsize(run / "curves.png") > 1000
    from meshfit.training.plot import read_records

    assert [r["step"] for r in read_records(str(tmp_path / "runs"))] == list(range(1, 11))
    assert read_records(str(tmp_path / "runs"))[4]["eval_acc"] == history.records[4]["eval_acc"]
