"""Stage 3: responses -> token ids + loss masks (format ``aerie.tokens/3``), with a fidelity report.

The training sequence is the prompt rendered by the target's own chat template with the generation
prompt (and the request's tools, system prompt and ``chat_template_kwargs``), followed by what the target
generated. The generated part of a text-only record is the template's own rendering of the finished turn
(``aerie.target_model.turns.render_turn``): prompt + assistant message rendered without a generation prompt must
begin with the prompt, and the rest is encoded in one piece (special tokens single ids, nothing merged
across the prompt boundary) and cut after the stop token the model samples (the template's turn end, or
the opener of the next turn for templates that write none). So Qwen3's ``<think>\\nR\\n</think>\\n\\nC``,
GLM's ``\\n<think>R</think>\\nC<|user|>``, gpt-oss's channels and Kimi K3's tags need no code of their own.
Each record's prompt length is its loss-mask boundary.

Whatever the template renders for a finished turn, a record the target's text cannot produce is refused with a
counted reason (an answer inside a reasoning block left open, e.g. Nemotron Nano v2's repeated open block). A
text-only record whose reasoning is missing (``null``) while reasoning was requested is missing data, dropped
(``no_reasoning``, per provider; ``aerie.tokens.reasoning``); empty reasoning is the model's own. Before any of
it, the tokenizer as loaded must keep every special marker of the template one id (``aerie.target_model.markers``).

Where the template cannot express the turn the record is refused with a counted reason, or framed by one
of two fallbacks learned from the template's own renders (path ``fallback``, counted per reason): a
template that drops the final turn's reasoning but renders reasoning in a tool-call turn (Kimi K2's
history rule) frames it as that tool-call turn does; a generation prompt that leaves the reasoning block
open or emptied where the turn renders ``</think>content`` (DeepSeek V3.1 thinking, V3.2 chat) puts the
model's text where the two renders meet. Every other anomaly is a
counted decision too: special-token text written by the model (``tokens.special_token_text``), a stop
token inside the text (always dropped), truncated and filtered answers (never given a turn end),
degenerate loops, text the template normalises (strip/trim), per provider.

When the backend kept the exact sampled ids (in-process ``hf``, SGLang ``/generate``) they are trained
on, and the text rebuild is compared with them: every mismatch is classified.

Modules, one job each (imported where used; nothing is re-exported here):
- ``stage``: ``tokenize_shard``, the rule's one call: read the responses records, decide per record, the
  drop gate (``too_many_dropped``), pack the kept sequences and write the shard and its report;
- ``rebuild``: the generated ids of one record from the template's text of its turn (``rebuild_generated``),
  and why a text rebuild differs from the ids the model sampled (``classify_mismatch``);
- ``reasoning``: whether a record's request asked for reasoning (torch-free: rule ``tokens`` reads it);
- ``fidelity``: the shard's fidelity report (counts, examples, mismatch classes, per-provider rates) and the
  providers that differ from the others across shards (``provider_stats``, ``provider_outliers``).
"""
