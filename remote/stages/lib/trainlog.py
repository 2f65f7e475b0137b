"""What a train stage keeps of speculators' training: the metrics its Trainer logs, and the loss plot.

speculators' ``Trainer`` (0.3 and 0.9 alike) logs one dict per step (``{"train": {...}, "epoch", "lr"}``)
and per validation pass (``{"val": {...}, "epoch"}``) on the ``speculators.metrics`` logger; a
``MetricsTap`` on that logger turns them into progress lines, metrics.json and loss.png.
"""
import json
import logging

from stages import common
from stages.lib import drafttypes


def _number(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


class MetricsTap(logging.Handler):
    """Collects the dicts speculators' Trainer logs on ``speculators.metrics`` and prints progress."""

    def __init__(self, total_steps: int, epochs: int = 0):
        """``total_steps`` when the caller knows it (0: not known ahead, as under speculators 0.9, whose
        loader packs the batches); then the total is estimated from ``epochs`` once the first epoch ends."""
        super().__init__()
        self.train, self.val, self.total, self.epochs = [], [], total_steps, epochs
        self._estimated, self._epoch_starts = not total_steps, {}

    def emit(self, record):
        entry = record.msg
        if not isinstance(entry, dict):
            return
        for part in ("train", "val"):  # 0.9 logs 0-d tensors where 0.3 logged floats
            if isinstance(entry.get(part), dict):
                entry = {**entry, part: {k: _number(v) for k, v in entry[part].items()}}
        if "train" in entry:
            self.train.append({"step": getattr(record, "step", len(self.train)), "epoch": entry["epoch"],
                               "lr": entry["lr"], **entry["train"]})
            done = len(self.train)
            self._epoch_starts.setdefault(entry["epoch"], done - 1)
            if self._estimated and self.epochs and len(self._epoch_starts) > 1:
                # the epochs so far, their mean length for the rest (the packing varies a little by epoch)
                finished = len(self._epoch_starts) - 1
                steps = self._epoch_starts[entry["epoch"]]  # those of the finished epochs
                self.total = round(steps + steps / finished * max(0, self.epochs - finished))
            self.total = max(self.total, done) if self.total else 0  # 0: no estimate yet, the bar has none
            common.progress(done, self.total, "steps")
            if done % 20 == 0 or done == 1 or (not self._estimated and done == self.total):
                common.log(f"step {done}/{self.total or '?'} loss {entry['train']['loss']:.4f} "
                           f"acc0 {entry['train'].get('full_acc_0', 0):.3f}")
        elif "val" in entry:
            self.val.append({"epoch": entry["epoch"], **entry["val"]})
            common.log(f"epoch {entry['epoch']} validation " + json.dumps(
                {k: round(v, 4) for k, v in entry["val"].items()}))


def plot(tap: MetricsTap, path, kind: str = "eagle3"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([m["step"] for m in tap.train], [m["loss"] for m in tap.train], label="train loss")
    if tap.val:
        per_epoch = max(1, len(tap.train) // max(1, len(tap.val)))
        ax.plot([(i + 1) * per_epoch for i in range(len(tap.val))], [m["loss_epoch"] for m in tap.val],
                "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (sum over TTT steps)" if kind == "eagle3" else "loss")
    ax.set_title(f"{drafttypes.NAMES.get(kind, kind)} draft training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
