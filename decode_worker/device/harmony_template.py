"""The chat template of the built-in tiny gpt-oss: OpenAI's harmony format, written here.

It renders what a gpt-oss template renders, in the same structure (so the API's harmony parser
and tool calls run against it), with a short system message (every byte is a token of the tiny
model): the reasoning effort, the valid channels, the tool routing line; a developer message
(the client's system/developer instructions and the tools as a `functions` namespace), then
the turns:

    <|start|>user<|message|>...<|end|>
    <|start|>assistant<|channel|>analysis<|message|>...<|end|>                (reasoning_content)
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{}<|call|>
    <|start|>functions.NAME to=assistant<|channel|>commentary<|message|>RESULT<|end|>  (tool)
    <|start|>assistant<|channel|>final<|message|>...<|end|>
    <|start|>assistant                                                        (generation prompt)

A tool message names its function with `name` (the API fills it in from the assistant's call
with the same `tool_call_id`). Variables: messages, tools, add_generation_prompt,
reasoning_effort (default "medium").
"""

HARMONY_CHAT_TEMPLATE = """\
{%- macro render_tools(tools) -%}
# Tools

## functions

namespace functions {
{% for tool in tools %}{% set fn = tool.function if tool.function is defined else tool %}
{% if fn.description %}// {{ fn.description }}
{% endif %}type {{ fn.name }} = {% if fn.parameters %}(_: {{ fn.parameters | tojson }})
{{- "" }}{% else %}(){% endif %} => any;
{% endfor %}
} // namespace functions
{%- endmacro -%}
<|start|>system<|message|>Reasoning: {{ reasoning_effort | default("medium", true) }}
# Valid channels: analysis, commentary, final.
{%- if tools %}

Calls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>
{%- set system_text = messages | selectattr("role", "in", ["system", "developer"])
    | map(attribute="content") | join("\\n") -%}
{%- if system_text or tools -%}
<|start|>developer<|message|>
{%- if system_text %}# Instructions

{{ system_text }}{% if tools %}

{% endif %}{% endif %}
{%- if tools %}{{ render_tools(tools) }}{% endif %}<|end|>
{%- endif -%}
{%- for m in messages if m.role not in ("system", "developer") -%}
{%- if m.role == "assistant" -%}
{%- if m.reasoning_content -%}
<|start|>assistant<|channel|>analysis<|message|>{{ m.reasoning_content }}<|end|>
{%- endif -%}
{%- if m.tool_calls -%}
{%- if m.content -%}
<|start|>assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- endif -%}
{%- for call in m.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) -%}
<|start|>assistant<|channel|>commentary to=functions.{{ fn.name }}
{{- " " }}<|constrain|>json<|message|>{{ args }}<|call|>
{%- endfor -%}
{%- elif m.content -%}
<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- endif -%}
{%- elif m.role == "tool" -%}
<|start|>functions.{{ m.name or "unknown" }} to=assistant<|channel|>commentary<|message|>
{{- m.content }}<|end|>
{%- else -%}
<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}
"""
