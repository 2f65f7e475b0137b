"""``speculators train`` in this process with its metrics tapped: the one way the current train stage trains.

The stage calls ``train_tapped`` directly on one device. Under torchrun (several GPUs, or several hosts
as one job) every rank runs this module, ``python -m stages.lib.trainworker METRICS_JSON ARGS...``, and
rank 0, the only rank whose metrics speculators logs, writes what its tap collected to METRICS_JSON for
the stage to read: the same metrics.json and loss.png whichever way it trained.
"""
import logging
import os
import sys

from hostcore import write_json
from stages.lib.trainlog import MetricsTap


def train_tapped(args: list[str]) -> MetricsTap:
    """speculators' own ``train`` (its CLI's main on its own config resolver) with ``args``."""
    from speculators.train.cli import main as speculators_train
    from speculators.train.config import TrainConfig

    tap = MetricsTap(0, epochs=int(args[args.index("--epochs") + 1]) if "--epochs" in args else 0)
    # speculators' own logging setup replaces the handlers of its loggers (dictConfig) and gives the
    # root logger a rich console handler only when it has none: so the tap, and a plain handler for
    # the other log lines, go on the root logger first (the metric dicts propagate up to it)
    root = logging.getLogger()
    lines = logging.StreamHandler(sys.stdout)
    lines.addFilter(lambda record: not record.name.startswith("speculators.metrics"))
    root.setLevel(logging.INFO)
    for handler in (tap, lines):
        root.addHandler(handler)
    try:
        speculators_train(TrainConfig.resolve(args))
    finally:
        for handler in (tap, lines):
            root.removeHandler(handler)
        for handler in logging.getLogger("speculators.metrics").handlers:  # pipeline.logger's: TensorBoard's
            handler.flush()                                                # event file whole before we return
    return tap


def die_with_torchrun() -> None:
    """Have the kernel kill this rank when its torchrun agent dies. torchrun starts each rank in a session
    of its own, so stopping the stage's process group (``inv runs.stop``, a multi-host job stopping its
    other nodes when one is lost) would leave the ranks behind, holding GPUs and memory and waiting for
    peers that are gone."""
    import ctypes
    import signal

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the agent's own shutdown is all there is
        return
    if os.getppid() != parent:  # the agent died before the request took effect
        os._exit(1)


def main(argv: list[str]) -> None:
    die_with_torchrun()
    metrics_path, args = argv[0], argv[1:]
    tap = train_tapped(args)
    if int(os.environ.get("RANK", "0")) == 0:
        write_json(metrics_path, {"train": tap.train, "val": tap.val})


if __name__ == "__main__":
    main(sys.argv[1:])
