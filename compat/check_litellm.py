"""litellm against the server: completion, stream, stop."""

import sys

import litellm

base_url, model = sys.argv[1], sys.argv[2]
args = {
    "model": f"openai/{model}",
    "api_base": base_url,
    "api_key": "unused",
    "temperature": 0,
    "max_tokens": 40,
    "messages": [{"role": "user", "content": "Describe the sea in two sentences."}],
}
whole = litellm.completion(**args).choices[0].message.content
streamed = "".join(
    c.choices[0].delta.content or "" for c in litellm.completion(**args, stream=True)
)
assert streamed == whole, (streamed, whole)
stop = whole[len(whole) // 2 : len(whole) // 2 + 3] or "."
cut = litellm.completion(**args, stop=[stop]).choices[0].message.content or ""
assert stop not in cut, (stop, cut)
print(f"completion/stream/stop: {len(whole)} chars, stop {stop!r} cut to {len(cut)}")
