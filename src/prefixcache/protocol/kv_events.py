"""KV events on the wire: vLLM's ZMQ format, a PUB stream plus a ROUTER replay socket.

Each batch is one PUB message of three frames, ``[topic, seq, payload]``: ``seq`` is an
8-byte big-endian counter from 0, ``payload`` the msgpack array ``[ts, events, dp_rank]``
with each event an array tagged by its class name, field order as in vLLM::

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
     medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
     kv_cache_spec_sliding_window, kv_cache_dtype]
    ["BlockRemoved", block_hashes, medium, group_idx]
    ["AllBlocksCleared"]

vLLM encodes these with msgspec ``array_like=True`` structs, where ``omit_defaults`` has no
effect: every field is written, ``None`` as nil, and a decoder ignores extra trailing
elements. ``extra_keys``, ``group_idx``, ``kv_cache_spec_kind`` and
``kv_cache_spec_sliding_window`` are newer vLLM's: extra keys are written nil (the salt and
LoRA are in the digest); ``group_idx`` is the KV cache group (0: the full layers,
``"full_attention"``, window nil; a hybrid pool's window group g: g + 1,
``"sliding_window"``, its window in tokens), on ``BlockRemoved`` too (whose group's kind
came with its ``BlockStored``). ``kv_cache_dtype`` is ours, after them ("float32",
"bfloat16", "int8": vLLM has no such field; a reader of vLLM's schema ignores it). A group
field of the wrong type from a peer (a string for ``group_idx``, a negative group) reads as
absent: group 0, full attention, no window. That is the ``array`` form; the ``map`` form
(newer vLLM, TensorRT-LLM: event structs without ``array_like``) writes each event as a
map tagged by ``"type"`` with the same field names, ``{"type": "BlockRemoved",
"block_hashes": [...], "medium": "cpu", "group_idx": 0}``, inside the same positional
batch. ``decode_batch`` reads both.

A replay client sends ``[b"", start]`` (8 bytes, big-endian) to the ROUTER and gets every
buffered batch with ``seq >= start`` as ``[b"", seq, payload]``, then the end marker
``[b"", -1 (signed), b""]``. A start past the last batch gets the marker alone, as in vLLM;
so does a malformed request (``parse_replay_request``). Topics are
``f"{prefix}.{epoch:016x}"``, a random epoch per boot (or per loss of events), so a consumer
can tell a restarted stream from a gap; or a fixed topic (``check_topic``), as vLLM has,
where a restart shows as ``seq`` going back to 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any, NamedTuple

import msgpack
import zmq

from prefixcache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker
SEQ_BYTES = 8  # a sequence number: unsigned, big-endian
MAX_REPLAY_FRAME_BYTES = 64  # a replay request's largest frame (its start is 8 bytes)
REPLAY_PROBLEMS = ("frame_count", "delimiter", "start_size", "start_ahead")  # metric labels
WIRE_FORMATS = ("array", "map")  # how events are written; the first is the default
MAX_TOPIC_CHARS = 256

# Field names in wire order, after the tag (vLLM's struct declaration order).
WIRE_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "kv_cache_dtype",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
_RECORDS: dict[str, type[KVEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


def _whole(value: Any, least: int) -> bool:
    """An int (not a bool) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


# A group field read from the wire is kept only if it passes its check (else: its default).
_GROUP_CHECKS: dict[str, Callable[[Any], bool]] = {
    "group_idx": lambda value: _whole(value, 0),
    "kv_cache_spec_kind": lambda value: isinstance(value, str),
    "kv_cache_spec_sliding_window": lambda value: _whole(value, 1),
}


def _event_to_wire(event: KVEvent) -> list[Any]:
    """One event as vLLM's tagged array (``lora_name`` and ``extra_keys`` are always nil
    here), then ours."""
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
            None,
            None,
            event.group_idx,
            event.kv_cache_spec_kind,
            event.kv_cache_spec_sliding_window,
            event.kv_cache_dtype,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium, event.group_idx]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {type(event).__name__}")


def _event_to_map(event: KVEvent) -> dict[str, Any]:
    """One event as the map form's tagged map: ``{"type": tag, field: value, ...}``."""
    wire = _event_to_wire(event)
    return dict(zip(("type", *WIRE_FIELDS[wire[0]]), wire, strict=True))


def encode_batch(
    ts: float, events: Sequence[KVEvent], dp_rank: int | None = None, wire_format: str = "array"
) -> bytes:
    """The msgpack payload of one batch: ``[ts, [tagged events...], dp_rank]``."""
    if wire_format not in WIRE_FORMATS:
        raise ValueError(f"wire format must be one of {', '.join(WIRE_FORMATS)}")
    encode = _event_to_wire if wire_format == "array" else _event_to_map
    body = [float(ts), [encode(e) for e in events], dp_rank]
    return msgpack.packb(body, use_bin_type=True)


def check_topic(topic: str) -> str:
    """A fixed topic as given; ValueError unless 1..MAX_TOPIC_CHARS printable characters."""
    if not topic or len(topic) > MAX_TOPIC_CHARS or not topic.isprintable():
        raise ValueError(
            f"a topic is 1 to {MAX_TOPIC_CHARS} printable characters (got {len(topic)} "
            f"characters{'' if topic.isprintable() else ', not all printable'})"
        )
    return topic


def _event_from_wire(item: Any) -> KVEvent | None:
    """A tagged array (or a newer vLLM's tagged map) as a record; None for unknown tags."""
    if isinstance(item, dict):
        tag = item.get("type")
        values = {k: item[k] for k in WIRE_FIELDS.get(tag, ()) if k in item}
    else:
        tag = item[0] if item else None
        values = dict(zip(WIRE_FIELDS.get(tag, ()), item[1:], strict=False))
    record = _RECORDS.get(tag) if isinstance(tag, str) else None
    if record is None:
        return None  # an event kind we do not track (vLLM has transfer events too)
    known = {f.name for f in fields(record)}  # lora_name, extra_keys: in the digest
    kept = {name: value for name, value in values.items() if name in known}
    for name, check in _GROUP_CHECKS.items():
        if name in kept and not check(kept[name]):
            del kept[name]  # nil, or a peer's wrong type: the default
    return record(**kept)


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    """Inverse of ``encode_batch``; also reads a batch or events encoded as maps."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if isinstance(batch, dict):
        ts, items = batch["ts"], batch["events"]
    else:
        ts, items = batch[0], batch[1]
    events = [e for e in map(_event_from_wire, items) if e is not None]
    return float(ts), events


# --- replay exchange (client side) -------------------------------------------------


def request_replay(
    dealer: zmq.Socket, start: int, timeout_s: float
) -> tuple[list[tuple[int, bytes]], bool]:
    """Ask a replay socket (through ``dealer``) for every batch with ``seq >= start``.

    Returns the ``(seq, payload)`` batches that arrived, in order, and whether the end
    marker came before ``timeout_s`` (the server's side: ``KVEventPublisher._serve_replay``).
    """
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got: list[tuple[int, bytes]] = []
    deadline = time.monotonic() + timeout_s
    while (remaining := deadline - time.monotonic()) > 0:
        if not dealer.poll(max(1, round(remaining * 1000))):
            break
        frames = dealer.recv_multipart()
        if len(frames) < 2:
            continue
        if frames[-2] == END_SEQ:
            return got, True
        got.append((int.from_bytes(frames[-2], "big", signed=True), frames[-1]))
    return got, False


# --- replay exchange (server side) -------------------------------------------------


class ReplayRequest(NamedTuple):
    """A replay request as the ROUTER got it: where to answer, and from where (or why not)."""

    envelope: list[bytes]  # [identity, b""] (REQ, or a DEALER speaking like one) or [identity]
    start: int  # the first seq asked for (0 when the request is malformed)
    problem: str | None = None  # one of REPLAY_PROBLEMS; None: a well-formed request


def parse_replay_request(frames: Sequence[bytes]) -> ReplayRequest:
    """``[identity, b"", start]`` or ``[identity, start]``, ``start`` 8 bytes big-endian.

    Never raises: anything else comes back with a ``problem`` (and the envelope a client
    of that shape reads the end marker from), for the server to answer with the marker alone.
    """
    identity = frames[0] if frames else b""
    if len(frames) == 3 and frames[1] == b"":
        envelope, body = [identity, b""], frames[2]
    elif len(frames) == 2:
        envelope, body = [identity], frames[1]
    elif len(frames) == 3:
        return ReplayRequest([identity], 0, "delimiter")
    else:
        delimited = len(frames) > 1 and frames[1] == b""
        return ReplayRequest([identity, b""] if delimited else [identity], 0, "frame_count")
    if len(body) != SEQ_BYTES:
        return ReplayRequest(envelope, 0, "start_size")
    return ReplayRequest(envelope, int.from_bytes(body, "big"))
