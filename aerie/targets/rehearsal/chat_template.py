"""The rehearsal target's chat template: Kimi K2.5's conversation format, written for aerie.

K2.5's own ``chat_template.jinja`` is not in any public source reachable here (llama.cpp keeps Kimi-K2 and
Kimi-K2-Thinking, not K2.5). This template is derived from the published Kimi-K2-Thinking template
(``../shared/fixtures/kimi-k2-thinking.chat_template.jinja``) plus what is documented about K2.5
(shared/notes/kimi-k2.5.md; its tokenizer code): the generation prompt opens ``<think>`` (``thinking=false``
closes it at once: ``<think></think>``), tools are declared in a first ``tool_declare`` system turn as the
tokenizer's TypeScript-style ``tools_ts_str`` (JSON when it is absent), and ``preserve_thinking`` keeps
the reasoning of earlier assistant turns. Rules kept from K2-Thinking: no newline between turns; the role
name is ``name or role``; a default system prompt when none is given; assistant turns up to the last one
without tool calls are history and lose their reasoning (``<think></think>``), later ones keep it; tool
results render as ``## Return of {id}``; tool calls as Kimi's section of ``functions.name:idx`` calls.
Rendered by transformers' sandboxed Jinja (trim_blocks / lstrip_blocks); every tag trims whitespace.
"""

from __future__ import annotations

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

CHAT_TEMPLATE = (
    r"""
{%- macro render_content(msg) -%}
  {%- set c = msg.get('content') -%}
  {%- if c is string -%}{{ c }}
  {%- elif c is not none -%}
    {%- for part in c -%}
      {%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}
        <|media_start|>image<|media_content|><|media_pad|><|media_end|>
      {%- else -%}{{ part['text'] }}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}

{%- macro role_header(msg) -%}
  {%- set name = msg.get('name') or msg['role'] -%}
  {%- if msg['role'] == 'user' -%}<|im_user|>{{ name }}<|im_middle|>
  {%- elif msg['role'] == 'assistant' -%}<|im_assistant|>{{ name }}<|im_middle|>
  {%- else -%}<|im_system|>{{ name }}<|im_middle|>
  {%- endif -%}
{%- endmacro -%}

{%- macro render_tool_calls(msg) -%}
  <|tool_calls_section_begin|>
  {%- for call in msg['tool_calls'] -%}
    <|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>
    {%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}
    {%- else -%}{{ call['function']['arguments'] | tojson }}
    {%- endif -%}
    <|tool_call_end|>
  {%- endfor -%}
  <|tool_calls_section_end|>
{%- endmacro -%}

{%- macro render_turn(msg, keep_reasoning) -%}
  {{- role_header(msg) -}}
  {%- if msg['role'] == 'assistant' -%}
    <think>
    {%- if keep_reasoning -%}{{ msg.get('reasoning_content') or '' }}{%- endif -%}
    </think>{{ render_content(msg) }}
    {%- if msg.get('tool_calls') -%}{{ render_tool_calls(msg) }}{%- endif -%}
  {%- elif msg['role'] == 'tool' -%}
    {{- '## Return of ' ~ msg.get('tool_call_id') ~ '\n' -}}{{ render_content(msg) }}
  {%- elif msg.get('content') is not none -%}{{ render_content(msg) }}
  {%- endif -%}
  <|im_end|>
{%- endmacro -%}

{%- set ns = namespace(last_plain=-1) -%}
{%- for i in range(messages | length - 1, -1, -1) -%}
  {%- if ns.last_plain == -1 and messages[i]['role'] == 'assistant' and not messages[i].get('tool_calls') -%}
    {%- set ns.last_plain = i -%}
  {%- endif -%}
{%- endfor -%}

{%- if tools -%}
  <|im_system|>tool_declare<|im_middle|>
  {%- if tools_ts_str is defined and tools_ts_str -%}{{ tools_ts_str }}
  {%- else -%}{{ tools | tojson }}
  {%- endif -%}
  <|im_end|>
{%- endif -%}

{%- if messages | length == 0 or messages[0]['role'] != 'system' -%}
  <|im_system|>system<|im_middle|>"""
    + DEFAULT_SYSTEM_PROMPT
    + r"""<|im_end|>
{%- endif -%}

{%- for msg in messages -%}
  {{- render_turn(msg, loop.index0 > ns.last_plain or (preserve_thinking is defined and preserve_thinking)) -}}
{%- endfor -%}

{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|><think>
  {%- if thinking is defined and not thinking -%}</think>{%- endif -%}
{%- endif -%}
""".strip()
)
