"""The EAGLE-3 data plane: one module per pipeline stage, run on the host with the uploaded remote/ tree as cwd.

Stage contract (every module here except ``common`` is a stage; ``lib/`` is the model code several
stages share, so that no stage imports another):

* At its top, after the imports, each stage declares in plain literals (the workstation reads them
  with ``ast.literal_eval``, without importing the stage, in harness/stagecontract.py):
  ``READS`` (the stages whose artifacts it reads: its ``inputs``, hence the pipeline's order),
  ``GPU`` (it needs the GPUs, so the production service is stopped, when the host has any) and
  ``SETTINGS`` (every pipeline setting it reads, with its default; ``common.COMMON_SETTINGS`` holds
  those every stage reads). The inventory's PipelineSpec takes its defaults from there, and a
  stage's run id hashes exactly these settings. ``main`` reads them once, first thing:
  ``cfg = common.settings(spec, SETTINGS)``, then ``cfg.<name>``.
* ``stages/<name>.py`` defines ``main(spec: dict) -> dict`` and runs as
  ``python -m stages.<name> SPEC_JSON_PATH`` (or through ``python -m runtime.runstage SPEC_JSON_PATH``, which
  the runner uses and which saves the returned dict as ``<run_dir>/result.json``).
* ``spec`` keys: ``run_id``, ``stage``, ``run_dir`` (outputs go to ``<run_dir>/artifacts/``),
  ``inputs`` (``{stage_name: artifacts dir of that stage's last successful run}``), ``model``
  (``path``, ``trust_remote_code``, ``revision``, ``gguf_file``, ``gguf_package``), ``pipeline``
  (settings from the inventory's PipelineSpec; an unset one takes the stage's declared default),
  and optionally ``workdir`` (the host's harness directory; default: two levels above ``run_dir``).
* The returned dict holds summary metrics (samples, tokens, loss, acceptance_length, ...).
* Progress: ``@@progress {"done": n, "total": N, "unit": "samples"}`` lines on stdout; other logs are
  plain stdout lines. SHA256SUMS are written by the runner's wrapper, not by stages.
* A mistake the user can fix raises ``SystemExit("stage <name>: <what> ...; fix <field>")``: one line,
  no traceback.

Data flow and formats (speculators 0.3.0's own, so its trainer and vLLM read them unchanged)::

    prepare  -> dataset/ (datasets.save_to_disk: input_ids, loss_mask), conversations.jsonl, heldout.jsonl
    extract  -> data/data_{i}.pt ({input_ids, hidden_states: [4 x (seq, hidden) bf16], loss_mask}),
                token_freq.pt, extract.json (layers, sizes)
    vocab    -> d2t.npy, t2d.npy
    train    -> checkpoint/ (config.json + model.safetensors), metrics.json, loss.png
    evaluate -> metrics.json (acceptance_length)

The layer convention (the off-by-one): ``pipeline.capture_layers`` are decoder layer indices whose
OUTPUT is captured, as speculators' VllmHiddenStatesGenerator does (``hidden_states + residual`` after
layer i; in transformers terms ``output_hidden_states[i + 1]``, before the final norm). vLLM, serving
an EAGLE-3 draft, instead collects the INPUT of each layer listed in the draft's
``eagle_aux_hidden_state_layer_ids``. So the checkpoint lists ``capture_layers[:3] + 1``; the fourth
captured layer only feeds the training targets. See ``common.vllm_aux_layer_ids``.
"""
