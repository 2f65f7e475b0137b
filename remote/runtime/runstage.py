"""Runs one stage of a run: ``python -m runtime.runstage <run_dir>/spec.json``, with the uploaded code as cwd.

Why a separate entry point rather than ``python -m stages.<name>``: every stage then gets the same
contract for free -- ``stages.<generation>.<name>.main(spec) -> dict`` (the spec's ``generation``;
without one, ``stages.<name>``; a job that names its ``module``, such as ``runtime.deploy``, that one), its dict saved as ``<run_dir>/result.json``
(atomically, so a half-written result never exists), an uncaught exception turned into a one-line
``@@harness`` message plus the traceback in the log and exit code 1, and ``sys.exit(n)`` kept as n.
The wrapper (templates/run/wrapper.sh.j2) starts this in its own process group and records the
exit code; progress is whatever the stage prints as ``@@progress {"done": n, "total": N, "unit": ...}``.
Stdlib only.
"""
import importlib
import json
import os
import sys
import time
import traceback

from hostcore import write_json


def main(argv):
    if len(argv) != 2:
        print("usage: python -m runtime.runstage RUN_DIR/spec.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        spec = json.load(f)
    run_dir = spec["run_dir"]
    os.makedirs(os.path.join(run_dir, "artifacts"), exist_ok=True)
    started = time.time()
    print("@@harness stage %s starting (run %s, pid %d)" % (spec["stage"], spec["run_id"], os.getpid()), flush=True)
    try:
        # the stages of the host's speculators line (stages/<generation>/), chosen by the harness; a
        # job that is not a pipeline stage (runtime.deploy) names its module
        package = "stages." + spec["generation"] if spec.get("generation") else "stages"
        module = importlib.import_module(spec.get("module") or package + "." + spec["stage"])
        result = module.main(spec)
    except KeyboardInterrupt:
        print("@@harness stage %s interrupted" % spec["stage"], flush=True)
        return 130
    except SystemExit as e:
        if isinstance(e.code, str):  # a user error the stage explains in one line (common.fail): no traceback
            why = e.code[len("stage %s: " % spec["stage"]):] if e.code.startswith("stage %s: " % spec["stage"]) else e.code
            print("@@harness stage %s failed: %s" % (spec["stage"], why), flush=True)
            return 1
        raise
    except Exception as e:
        traceback.print_exc()
        sys.stderr.flush()
        print("@@harness stage %s failed: %s: %s" % (spec["stage"], type(e).__name__, e), flush=True)
        return 1
    result = dict(result or {})
    result.setdefault("seconds", round(time.time() - started, 3))
    write_json(os.path.join(run_dir, "result.json"), result)
    print("@@harness stage %s done in %.1fs" % (spec["stage"], time.time() - started), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
