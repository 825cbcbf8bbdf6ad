"""``saffu train --tensorboard`` writes every evaluation's figures as TensorBoard events beside
``metrics.jsonl``: the same values at the same steps."""

import json
import shutil
import struct

import pytest

from saffu.cli import main

tensorboardX = pytest.importorskip("tensorboardX")


def _events(path) -> list:
    """The events of one event file (TFRecord framing: length, its CRC, the record, its CRC)."""
    from tensorboardX.proto import event_pb2
    data, at, events = path.read_bytes(), 0, []
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at:at + 8])
        events.append(event_pb2.Event.FromString(data[at + 12:at + 12 + length]))
        at += 12 + length + 4
    return events


def _scalars(folder) -> dict[str, dict[int, float]]:
    """Every scalar of the event files in ``folder``."""
    out: dict[str, dict[int, float]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        for event in _events(path):
            for value in event.summary.value:
                out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


def test_events_hold_the_metrics_of_every_evaluation(tiny_workdir, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--workdir", str(tiny_workdir.path), "--run", str(run), "--init", "random", "--model",
                 "transformer", "--width", "16", "--layers", "1", "--attention-heads", "2", "--context", "4",
                 "--max-len", "24", "--steps", "6", "--eval-every", "3", "--batch-size", "2", "--seq-len", "8",
                 "--eval-tokens", "0", "--tensorboard", "--quiet"]) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scalars = _scalars(run / "tensorboard")
    assert sorted(scalars["dev_loss"]) == [line["step"] for line in lines] == [0, 3, 6]
    for line in lines:
        assert scalars["dev_loss"][line["step"]] == pytest.approx(line["dev_loss"], rel=1e-6)
    assert scalars["train_loss"][6] == pytest.approx(lines[-1]["train_loss"], rel=1e-6)


def test_a_run_restarted_before_its_first_checkpoint_purges_its_earlier_events(tiny_workdir, tmp_path):
    from tensorboardX.proto.event_pb2 import SessionLog
    run = tmp_path / "run"
    argv = ["train", "--workdir", str(tiny_workdir.path), "--run", str(run), "--init", "random", "--model",
            "transformer", "--width", "16", "--layers", "1", "--attention-heads", "2", "--context", "4",
            "--max-len", "24", "--steps", "2", "--eval-every", "1", "--checkpoint-every", "0", "--batch-size", "2",
            "--seq-len", "8", "--eval-tokens", "0", "--tensorboard", "--quiet"]
    assert main(argv) == 0
    for step in (run / "checkpoints").iterdir():       # as if killed before its one checkpoint
        if step.name.isdigit():
            shutil.rmtree(step)
    assert main(argv) == 0
    _, second = sorted((run / "tensorboard").glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    starts = [e.step for e in _events(second) if e.HasField("session_log") and e.session_log.status == SessionLog.START]
    assert starts == [0]        # TensorBoard drops the first file's events from step 0 on
