"""litellm against the server: tool_choice required, whole and streamed."""

import json
import sys

import litellm

base_url, model = sys.argv[1], sys.argv[2]
tools = [{"type": "function", "function": {
    "name": "find_train", "description": "Find trains between two cities.",
    "parameters": {"type": "object", "required": ["origin", "destination"], "properties": {
        "origin": {"type": "string"}, "destination": {"type": "string"}}},
}}]  # fmt: skip
args = {
    "model": f"openai/{model}",
    "api_base": base_url,
    "api_key": "unused",
    "temperature": 0,
    "max_tokens": 60,
    "tools": tools,
    "tool_choice": "required",
    "messages": [{"role": "user", "content": "Find me a train from Rome to Milan."}],
}
call = litellm.completion(**args).choices[0].message.tool_calls[0]
arguments = json.loads(call.function.arguments)
assert call.function.name == "find_train" and set(arguments) >= {"origin", "destination"}, call
chunks = list(litellm.completion(**args, stream=True))
streamed = litellm.stream_chunk_builder(chunks).choices[0].message.tool_calls[0]
assert json.loads(streamed.function.arguments) == arguments, (streamed, arguments)
print(f"tool call {call.function.name}({', '.join(arguments)}), same when streamed")
