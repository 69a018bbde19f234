"""Chat templates that take `tools`, written for the tests in the manner of two families'
templates (no download): Qwen2.5's (ChatML; tools as JSON lines in the system turn; calls in
<tool_call> tags; tool results in <tool_response> tags of a user turn) and Llama 3.1's
(header tokens; tools as indented JSON in the first user turn; calls as {"name",
"parameters"}; results in ipython turns). They use what those templates use: `tools`,
`tojson` (with indent), looks at neighbouring messages, list slicing, `strftime_now`,
`raise_exception`."""

QWEN25_STYLE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}"
    "{%- else %}{{- 'You help.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall one as <tool_call>\\n{"name": <name>, "arguments": <object>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}'
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA31_STYLE = (
    "{{- bos_token }}"
    "{%- if not tools is defined %}{%- set tools = none %}{%- endif %}"
    "{%- if not date_string is defined %}{%- set date_string = strftime_now('%d %b %Y') %}"
    "{%- endif %}"
    "{%- if messages[0].role == 'system' %}"
    "{%- set system_message = messages[0].content | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' + system_message + '<|eot_id|>' }}"
    "{%- if tools is not none %}"
    "{%- if messages | length == 0 %}{{- raise_exception('tools need a user turn') }}{%- endif %}"
    "{%- set first_user_message = messages[0].content | trim %}{%- set messages = messages[1:] %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}"
    '{{- \'To call a function, answer {"name": name, "parameters": object}. Functions:\\n\\n\' }}'
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- first_user_message + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}"
    "{{- message.content | trim + '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}"
    "{%- if not message.tool_calls | length == 1 %}{{- raise_exception('one call a turn') }}"
    "{%- endif %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    '{{- \'{"name": "\' + tool_call.name + \'", "parameters": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{%- if message.content is mapping %}{{- message.content | tojson }}"
    "{%- else %}{{- message.content }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
