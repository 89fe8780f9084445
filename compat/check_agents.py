"""The OpenAI Agents SDK against the server: an agent with one function tool, Responses API."""

import sys

from openai import AsyncOpenAI

from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

base_url, model = sys.argv[1], sys.argv[2]
set_tracing_disabled(True)  # the SDK would export traces to OpenAI
calls: list[tuple[str, int]] = []


@function_tool
def train_times(city: str, hour: int) -> str:
    """The departures from a city's main station within an hour of the day (0-23)."""
    calls.append((city, hour))
    return f"Trains from {city} at {hour}:05 and {hour}:35."


client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
agent = Agent(
    name="railway desk",
    instructions="You answer questions about trains. Use the tools.",
    tools=[train_times],
    model=OpenAIResponsesModel(model=model, openai_client=client),
    model_settings=ModelSettings(
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=64
    ),  # one call: the tiny model would repeat it until max_tokens
    tool_use_behavior="stop_on_first_tool",  # the tool's output is the final output
)
result = Runner.run_sync(agent, "When do trains leave Lyon around 9 in the morning?", max_turns=2)
assert len(calls) == 1 and isinstance(calls[0][0], str) and isinstance(calls[0][1], int), calls
assert result.final_output and result.final_output.startswith("Trains from"), result.final_output
# Then the model runs again on the tool's output (a function_call_output item) and answers.
again = Runner.run_sync(
    agent.clone(tool_use_behavior="run_llm_again"), "And Nice at 18?", max_turns=4
)
kinds = [type(item).__name__ for item in again.new_items]
assert kinds[-1] == "MessageOutputItem" and "ToolCallOutputItem" in kinds, kinds
assert len(calls) >= 2 and isinstance(again.final_output, str) and again.final_output, again
print(
    f"Responses API: tool call {calls[0]!r}, final output {len(result.final_output)} chars; "
    f"then {len(kinds)} items ending in a message of {len(again.final_output)} chars"
)
