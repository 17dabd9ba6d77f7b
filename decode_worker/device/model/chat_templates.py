"""Chat templates of the tiny random models of each family (`tiny.py`): shortened forms of the
templates the real checkpoints ship (every byte is a token of the tiny models, so the tool
instructions are cut to a line), with the same turn markers and the same tool-call and
reasoning syntax, so the API's parsers meet what the real models produce:

- Qwen3 (ChatML): `<|im_start|>role\\n...<|im_end|>`, reasoning in `<think>...</think>`, tools
  listed in `<tools>`, calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  results as `<tool_response>` in a user turn;
- Llama 3.x: `<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>`, tools as JSON in
  the first user turn, calls as `{"name": ..., "parameters": {...}}`, results in an `ipython`
  turn;
- Gemma 3: `<start_of_turn>user|model\\n...<end_of_turn>`, the system prompt folded into the
  first user turn.
"""

QWEN3_TEMPLATE = """\
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call: <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}
<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}
<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}

<tool_call>
{"name": "{{ fn.name }}", "arguments": {{ fn.arguments if fn.arguments is string \
else fn.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}
{%- endif %}"""

LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' and loop.index0 == (messages | map(attribute='role') | list)\
.index('user') and tools %}
<|start_header_id|>user<|end_header_id|>

Answer with {"name": function name, "parameters": arguments} calling one of:
{% for tool in tools %}{{ tool | tojson }}

{% endfor %}{{ message.content | trim }}<|eot_id|>
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- set fn = message.tool_calls[0].function %}
<|start_header_id|>assistant<|end_header_id|>

{"name": "{{ fn.name }}", "parameters": {{ fn.arguments if fn.arguments is string \
else fn.arguments | tojson }}}<|eot_id|>
{%- elif message.role == 'tool' %}
<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}
<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content | trim }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

GEMMA3_TEMPLATE = """\
{{- bos_token }}
{%- set first = messages[0].content if messages[0].role == 'system' else '' %}
{%- for message in messages if message.role != 'system' %}
{%- set role = 'model' if message.role == 'assistant' else 'user' %}
<start_of_turn>{{ role }}
{% if loop.first and first %}{{ first }}

{% endif %}{{ message.content | trim }}<end_of_turn>
{% endfor %}
{%- if add_generation_prompt %}
<start_of_turn>model
{% endif %}"""
