"""Chat templates Tidepool ships, and which template renders a request.

A request with tools needs a template that shows the model its tools and renders earlier
tool calls and results. The model's own template is used when it does (it mentions
``tools``); otherwise a ChatML model (``<|im_start|>``, as SmolLM2, Qwen and Hermes use)
gets :data:`HERMES_TOOLS`: NousResearch's Hermes 2 Pro function-calling format, the one
Qwen2.5 and vLLM's ``hermes`` parser use, with tools listed in the system turn as JSON
inside ``<tools></tools>``, calls written as ``<tool_call>{json}</tool_call>`` and results
returned as ``<tool_response>`` inside a user turn. Without tools, the model's template
renders the request. ``--chat-template`` replaces all of this with one template.
"""

from __future__ import annotations

HERMES_TOOLS = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def renders_tools(template: str | None) -> bool:
    """Whether a template shows the model its tools (it reads the ``tools`` variable)."""
    return bool(template) and "tools" in template


def is_chatml(template: str | None) -> bool:
    return bool(template) and "<|im_start|>" in template


def tools_template(model_template: str | None, override: str | None) -> str | None:
    """The template for a request with tools (None: this model cannot be given tools)."""
    if override is not None:
        return override
    if renders_tools(model_template):
        return model_template
    if is_chatml(model_template):
        return HERMES_TOOLS
    return None
