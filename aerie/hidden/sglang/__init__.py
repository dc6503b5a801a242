"""Hidden-state capture through SGLang (``hidden.backend: sglang``), for targets only SGLang can run.

Route (SGLang 0.5.23, pinned in envs/sglang.yaml). SGLang's serving Engine can return aux hidden states
(``--enable-return-aux-hidden-states``), but in that mode the response carries the aux states *instead of*
the final ones, and as Python lists (``tolist()`` of 3 x 7168 floats a token for Kimi) sent between its
processes, which would cost more than the forward itself.
So, like SpecForge's offline capture and SGLang's own ``sglang.benchmark.one_batch``, each tensor-parallel
rank runs a ``ModelRunner`` in a worker process and does one extend (prefill) forward per batch with
``CaptureHiddenMode.FULL``. The server arguments ``enable_return_aux_hidden_states=True``,
``speculative_algorithm="EAGLE3"`` and ``return_aux_hidden_state_layer_ids=<aerie ids>`` make SGLang
itself call the model's ``set_eagle3_layers_to_capture(ids)`` - the exact call it makes when it serves a
drafter whose ``eagle_config.eagle_aux_hidden_state_layer_ids`` are those ids - and keep the post-norm
final state of every token beside the aux states (``LogitsProcessorOutput.last_hidden_states``).
Rank 0 copies both into shared memory; the parent splits them per sequence.

Layer ids. aerie's id ``i`` is the output of 0-based decoder layer ``i`` (transformers'
``output_hidden_states[i + 1]``). SGLang captures the residual stream at the *input* of the layers in
``model.layers_to_capture``; ``set_eagle3_layers_to_capture`` sets that to ``[i + 1 for i in ids]`` for
most models (llama.py, qwen2.py, ...), which is the same tensor. DeepseekV2/V3 (and so Kimi K2.5) add the
1 only when the first id is 1 and otherwise capture the inputs of the ids themselves, one layer early.
After loading, the worker reads ``layers_to_capture`` back from the model and the capture refuses to run
unless it equals ``[i + 1 for i in ids]``: training data then matches both aerie's convention and what
SGLang feeds the drafter when it serves it. SGLang cannot capture the last layer's output (no layer
follows it), so id ``L - 1`` is refused up front.

Modules, one job each:
- :mod:`~aerie.hidden.sglang.mapping` (no torch): the id convention, SGLang's arguments, GPU ids, the
  forward plan, the errors;
- :mod:`~aerie.hidden.sglang.batches`: sequences in, SGLang's flat outputs split and checked;
- :mod:`~aerie.hidden.sglang.sglang_0523`: :class:`SGLang0523`, everything that touches SGLang internals;
- :mod:`~aerie.hidden.sglang.worker`: the worker processes (importable by name, so they start whatever the
  parent runs as) and why a dead one died;
- :mod:`~aerie.hidden.sglang.capture`: :class:`SGLangCapture`, what aerie.hidden uses;
- :mod:`~aerie.hidden.sglang_check.check` and :mod:`~aerie.hidden.sglang_check.cli`: ``aerie-sglang-capture check``
  (or ``python -m aerie.hidden.sglang_check check``) compares against transformers on a GPU host.
All but the adapter are tested without SGLang.
"""
