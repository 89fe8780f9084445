"""langchain-openai against the server: with_structured_output both ways, bind_tools forced."""

import sys

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

base_url, model = sys.argv[1], sys.argv[2]
llm = ChatOpenAI(base_url=base_url, api_key="unused", model=model, temperature=0, max_tokens=120)


class Ticket(BaseModel):
    """A train ticket."""

    origin: str
    destination: str
    seats: int = Field(ge=1, le=9)


@tool
def book(origin: str, destination: str, seats: int) -> str:
    """Book seats on a train from origin to destination."""
    return f"booked {seats} seats {origin}-{destination}"


question = "Two seats from Paris to Lyon, please."
parsed = []
for method in ("json_schema", "function_calling"):
    ticket = llm.with_structured_output(Ticket, method=method).invoke(question)
    assert isinstance(ticket, Ticket), ticket
    parsed.append(method)
message = llm.bind_tools([book], tool_choice="book").invoke(question)
assert message.tool_calls and message.tool_calls[0]["name"] == "book", message
booked = book.invoke(message.tool_calls[0]["args"])  # the arguments fit the tool's schema
print(f"structured output ({', '.join(parsed)}) parsed; bind_tools forced call: {booked!r}")
