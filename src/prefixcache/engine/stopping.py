"""When a completion ends: stop tokens, stop strings, max_tokens and the context."""

from __future__ import annotations

from collections.abc import Collection

from prefixcache.engine.logprobs import Logprob
from prefixcache.engine.request import Branch, CompletionOutput, FinishReason


def stop_reason(branch: Branch, token: int, eos_token_ids: Collection[int]) -> FinishReason | None:
    """STOP for a stop token or (unless ignored) an end-of-sequence token."""
    params = branch.request.params
    if token in params.stop_token_ids:
        return FinishReason.STOP
    if not params.ignore_eos and token in eos_token_ids:
        return FinishReason.STOP
    return None


def stop_token_ids(branch: Branch, eos_token_ids: Collection[int]) -> list[int]:
    """Every id that would end this branch: what ``min_tokens`` masks."""
    params = branch.request.params
    return [*params.stop_token_ids, *([] if params.ignore_eos else eos_token_ids)]


def append_output(branch: Branch, token: int, logprob: Logprob | None = None) -> bool:
    """Add a generated token and its text; True if the text now reaches a stop string.

    Stop strings are not looked for before ``min_tokens`` tokens (as vLLM does).
    """
    output = branch.output
    output.token_ids.append(token)
    if output.logprobs is not None and logprob is not None:
        output.logprobs.append(logprob)
    new_text = branch.decoder.push(token)
    output.text += new_text
    output.text_ends.append(len(output.text))
    if len(output.token_ids) < branch.request.params.min_tokens:
        return False
    return cut_at_stop_string(output, len(new_text), branch.request.params.stop)


def cut_at_stop_string(output: CompletionOutput, new_chars: int, stops: list[str]) -> bool:
    """Truncate the text before the earliest stop string that the new text completed."""
    cuts = []
    for stop in stops:
        cut = output.text.find(stop, max(0, len(output.text) - new_chars - len(stop) + 1))
        if cut != -1:
            cuts.append(cut)
    if not cuts:
        return False
    output.text = output.text[: min(cuts)]
    return True


def length_reason(branch: Branch, max_model_len: int) -> FinishReason | None:
    """LENGTH once max_tokens or the model's context is reached."""
    request = branch.request
    generated = len(branch.output.token_ids)
    if generated >= request.params.max_tokens:
        return FinishReason.LENGTH
    if request.prompt_length + generated >= max_model_len:
        return FinishReason.LENGTH
    return None
