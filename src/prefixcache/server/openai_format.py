"""Responses and SSE chunks in the shapes OpenAI clients parse."""

from __future__ import annotations

import json
import time

from prefixcache.engine.request import RequestOutput


def usage(output: RequestOutput) -> dict:
    """Token counts, with the cached share of the prompt."""
    completion = sum(len(o.token_ids) for o in output.outputs)
    prompt = len(output.prompt_token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
    }


def _finish(reason) -> str | None:
    return None if reason is None else str(reason)


def chat_response(request_id: str, model: str, output: RequestOutput) -> dict:
    choices = [
        {
            "index": o.index,
            "message": {"role": "assistant", "content": o.text},
            "finish_reason": _finish(o.finish_reason),
            "logprobs": None,
        }
        for o in output.outputs
    ]
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(output),
    }


def completion_response(request_id: str, model: str, output: RequestOutput) -> dict:
    choices = [
        {
            "index": o.index,
            "text": o.text,
            "finish_reason": _finish(o.finish_reason),
            "logprobs": None,
        }
        for o in output.outputs
    ]
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(output),
    }


class StreamFormatter:
    """Turns successive snapshots of a request into OpenAI SSE chunks (text deltas)."""

    def __init__(self, request_id: str, model: str, chat: bool, n: int) -> None:
        self.request_id, self.model, self.chat = request_id, model, chat
        self.sent_text = [0] * n
        self.sent_finish = [False] * n
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def first_chunks(self) -> list[str]:
        """Chat streams open with the assistant role, one chunk per choice."""
        if not self.chat:
            return []
        return [
            self._event(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                        "logprobs": None,
                    }
                ]
            )
            for i in range(len(self.sent_text))
        ]

    def chunks(self, output: RequestOutput) -> list[str]:
        """One chunk per choice that has new text or has just finished."""
        events = []
        for o in output.outputs:
            delta = o.text[self.sent_text[o.index] :]
            finished = o.finish_reason is not None and not self.sent_finish[o.index]
            if not delta and not finished:
                continue
            self.sent_text[o.index] = len(o.text)
            self.sent_finish[o.index] |= finished
            choice = {
                "index": o.index,
                "finish_reason": _finish(o.finish_reason) if finished else None,
                "logprobs": None,
            }
            if self.chat:
                choice["delta"] = {"content": delta} if delta else {}
            else:
                choice["text"] = delta
            events.append(self._event([choice]))
        return events

    def usage_chunk(self, output: RequestOutput) -> str:
        return self._event([], usage=usage(output))

    def _event(self, choices: list[dict], **extra: object) -> str:
        body = {
            "id": self.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(body)}\n\n"


DONE = "data: [DONE]\n\n"
