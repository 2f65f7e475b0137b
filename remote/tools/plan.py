"""The facts ``inv pipeline --plan`` sizes a pipeline with, read on the host before anything loads.

Stdlib only, one round trip, nothing written: the target's shape from its config.json (the text model of
a multimodal wrapper: ``text_config`` and its kin), or from a GGUF's header, or from the hub cache for a
hub id; the installed speculators (which stage generation runs); the GPUs; the free space under the
workdir; and the state of each run id the harness would launch (with prepare's token count once it
succeeded). The verdict is the harness's (harness/plan.py): this only reads.

    spec: {"workdir": "~/.eagle-harness", "model": {...inventory model...}, "run_ids": ["prepare-...", ...]}
"""
import glob
import importlib.util
import json
import os
import struct

import probe
import runctl
from hostcore import text_config, text_config_key

#: GGUF metadata value types (gguf's GGUFValueType): struct format of the scalar ones
GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
GGUF_STRING, GGUF_ARRAY = 8, 9


def _shape(cfg, source):
    """layers, hidden size, vocabulary and dtype of the language model a config.json describes."""
    text, nested = text_config(cfg), text_config_key(cfg)
    out = {"source": source, "architectures": cfg.get("architectures"), "model_type": text.get("model_type"),
           "text_config": nested, "num_hidden_layers": text.get("num_hidden_layers"),
           "hidden_size": text.get("hidden_size"), "vocab_size": text.get("vocab_size"),
           "torch_dtype": text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype")}
    missing = [k for k in ("num_hidden_layers", "hidden_size") if not isinstance(out[k], int)]
    if missing:
        out["error"] = "%s has no %s" % (source, " or ".join(missing))
    return out


def _read_gguf_meta(path, wanted):
    """The metadata keys ``wanted`` (and the length of ``tokenizer.ggml.tokens``) of a GGUF file,
    reading its header only (the key/value section precedes the tensors)."""
    found = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        version = struct.unpack("<I", f.read(4))[0]
        count_fmt = "<I" if version == 1 else "<Q"
        size = struct.calcsize(count_fmt)
        struct.unpack(count_fmt, f.read(size))  # tensor count
        n_kv = struct.unpack(count_fmt, f.read(size))[0]

        def string():
            n = struct.unpack(count_fmt, f.read(size))[0]
            return f.read(n).decode("utf-8", "replace")

        def value(kind):
            if kind in GGUF_SCALARS:
                fmt = "<" + GGUF_SCALARS[kind]
                return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
            if kind == GGUF_STRING:
                return string()
            if kind == GGUF_ARRAY:
                item = struct.unpack("<I", f.read(4))[0]
                n = struct.unpack(count_fmt, f.read(size))[0]
                if item in GGUF_SCALARS:  # skipped, not decoded
                    f.seek(n * struct.calcsize("<" + GGUF_SCALARS[item]), 1)
                else:
                    for _ in range(n):
                        value(item)
                return n  # an array's length is all this reader keeps
            raise ValueError("unknown GGUF value type %d" % kind)

        for _ in range(n_kv):
            key = string()
            kind = struct.unpack("<I", f.read(4))[0]
            v = value(kind)
            if key in wanted:
                found[key] = v
            if all(k in found for k in wanted):
                break
    return found


def _gguf_path(model):
    """The GGUF the model spec names (stages/common.py's rule): in an installed package, or at ``path``."""
    name = model.get("gguf_file")
    if model.get("gguf_package"):
        spec = importlib.util.find_spec(model["gguf_package"])  # finds, does not import
        if spec is None or not spec.submodule_search_locations:
            return None, "model.gguf_package %r is not installed in the host's python" % model["gguf_package"]
        folder = list(spec.submodule_search_locations)[0]
    else:
        folder = os.path.expanduser(model.get("path") or "")
        if os.path.isfile(folder):
            folder, name = os.path.dirname(folder), os.path.basename(folder)
    if not name:
        found = sorted(glob.glob(os.path.join(folder, "*.gguf")))
        if len(found) != 1:
            return None, "%d .gguf files in %s" % (len(found), folder)
        return found[0], None
    return os.path.join(folder, name), None


def model_shape(model):
    """The target's shape, wherever the inventory's model is: a directory, a GGUF, or a hub id already in
    the host's hub cache. ``error`` says why it could not be read."""
    model = model or {}
    path = model.get("path") or ""
    if model.get("gguf_file") or model.get("gguf_package") or path.endswith(".gguf"):
        gguf, why = _gguf_path(model)
        if gguf is None or not os.path.isfile(gguf):
            return {"source": gguf, "error": why or "no GGUF at %s" % gguf}
        try:
            arch = _read_gguf_meta(gguf, ["general.architecture"])["general.architecture"]
            meta = _read_gguf_meta(gguf, ["%s.block_count" % arch, "%s.embedding_length" % arch,
                                          "tokenizer.ggml.tokens"])
        except (OSError, ValueError, KeyError, struct.error) as e:
            return {"source": gguf, "error": "cannot read the GGUF header of %s: %s" % (gguf, e)}
        return {"source": gguf, "architectures": None, "model_type": arch, "text_config": None,
                "num_hidden_layers": meta.get("%s.block_count" % arch),
                "hidden_size": meta.get("%s.embedding_length" % arch),
                "vocab_size": meta.get("tokenizer.ggml.tokens"), "torch_dtype": None}
    candidates = [os.path.join(os.path.expanduser(path), "config.json")]
    if "/" in path and not os.path.exists(os.path.expanduser(path)):  # a hub id: the hub cache, if it has it
        hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
            os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub")
        candidates += sorted(glob.glob(os.path.join(hub, "models--" + path.replace("/", "--"), "snapshots", "*",
                                                    "config.json")))
    for c in candidates:
        if os.path.isfile(c):
            try:
                with open(c) as f:
                    return _shape(json.load(f), c)
            except (OSError, ValueError) as e:
                return {"source": c, "error": "cannot read %s: %s" % (c, e)}
    return {"source": None, "error": "model.path %r: no config.json on the host (not a directory, and not in the "
                                     "hub cache)" % path}


def run_states(workdir, run_ids):
    """{run id: {state, tokens}}: the runs the pipeline would reuse, and prepare's count once known."""
    out = {}
    for rid in run_ids:
        st = runctl.read_status(os.path.join(workdir, "runs", rid)) if runctl.RUN_ID.match(rid) else None
        if st is None:
            out[rid] = {"state": None}
            continue
        result = st.get("result") or {}
        out[rid] = {"state": st.get("state"), "tokens": result.get("tokens"), "samples": result.get("samples"),
                    "heldout_coverage": result.get("heldout_coverage")}
    return out


def main(spec):
    workdir = os.path.expanduser(spec.get("workdir") or "~/.eagle-harness")
    return {
        "speculators": probe.package_version("speculators"),
        "gpus": probe.gpus(),
        "native_bf16": probe.native_bf16(),
        "disk": probe.disk(workdir),
        "model": model_shape(spec.get("model")),
        "runs": run_states(workdir, spec.get("run_ids") or []),
    }
