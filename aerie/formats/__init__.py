"""aerie's on-disk formats: one module per format, holding its version constant, writer and reader together.

Every format is documented once, in docs/formats.md, and versioned in the file itself (a ``format`` key in
JSON records and in safetensors metadata). Stages import these modules; these import only aerie.tools.artifacts
(atomic publishing, packed safetensors, JSONL) and never a stage.

- ``responses``: ``aerie.responses/1`` JSONL shards (one record per sample).
- ``tokens``: ``aerie.tokens/3`` packed token ids + loss masks, and the mask check every reader runs.
- ``hidden``: ``aerie.hidden/2`` captured aux states (compact or full layout) and its reader.
- ``vocab``: ``aerie.draft-vocab/1``, the draft vocabulary SGLang's EAGLE-3 drafter reads (d2t, t2d).
"""
