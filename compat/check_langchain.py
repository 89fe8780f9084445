"""langchain-openai against the server: invoke, stream, stop."""

import sys

from langchain_openai import ChatOpenAI

base_url, model = sys.argv[1], sys.argv[2]
llm = ChatOpenAI(base_url=base_url, api_key="unused", model=model, temperature=0, max_tokens=40)
question = [("user", "Tell me about trains in two sentences.")]
whole = llm.invoke(question).content
streamed = "".join(chunk.content for chunk in llm.stream(question))
assert streamed == whole, (streamed, whole)
stop = whole[len(whole) // 2 : len(whole) // 2 + 3] or "."
cut = llm.invoke(question, stop=[stop]).content
assert stop not in cut and "".join(c.content for c in llm.stream(question, stop=[stop])) == cut
print(f"invoke/stream/stop: {len(whole)} chars, stop {stop!r} cut to {len(cut)}")
