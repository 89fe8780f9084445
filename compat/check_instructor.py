"""instructor against the server: a validated pydantic instance in TOOLS and JSON_SCHEMA modes."""

import sys
from enum import StrEnum

import instructor
from openai import OpenAI
from pydantic import BaseModel, Field

base_url, model = sys.argv[1], sys.argv[2]


class Line(StrEnum):
    regional = "regional"
    intercity = "intercity"
    night = "night"


class Station(BaseModel):
    city: str
    platform: int


class Journey(BaseModel):
    line: Line
    stops: list[str] = Field(max_length=4)
    departure: Station


question = "A night train leaves Paris from platform 3 and stops at Dijon and Lyon. Extract it."
outcomes = []
for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
    client = instructor.from_openai(OpenAI(base_url=base_url, api_key="unused"), mode=mode)
    journey = client.chat.completions.create(
        model=model, response_model=Journey, max_retries=0, temperature=0, max_tokens=160,
        messages=[{"role": "user", "content": question}],
    )  # fmt: skip
    assert isinstance(journey, Journey) and isinstance(journey.line, Line), journey
    outcomes.append(f"{mode.name} {journey.line.value}/{len(journey.stops)} stops")
print("validated: " + ", ".join(outcomes))
