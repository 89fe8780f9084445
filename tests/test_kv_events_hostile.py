"""Nothing a neighbour sends to the KV-event sockets stops the events (issue 21).

A DEALER on 127.0.0.1 plays the attacker against a real publisher: malformed replay
requests of every shape, the issue's 9-byte ``ff`` start, frames too big for libzmq to
accept, a request of many frames, a huge subscription. After each, an honest replay still
gets its batches, the PUB socket still publishes, and the thread is alive. A peer's events
with KV cache group fields of the wrong type read as if the fields were absent.
"""

from __future__ import annotations

import random
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from event_fixtures import (
    answers,
    dealer,
    pub_delivers,
    publish_block,
    publishers,
    replay_holds,
)
from prefixcache.cache.events import BlockRemoved, BlockStored
from prefixcache.protocol.kv_events import (
    END_SEQ,
    MAX_REPLAY_FRAME_BYTES,
    REPLAY_PROBLEMS,
    WIRE_FIELDS,
    decode_batch,
    parse_replay_request,
)
from prefixcache.server.events import KVEventPublisher

Factory = Callable[..., KVEventPublisher]
FF8 = b"\xff" * 8

# What the DEALER sends (the ROUTER adds the identity frame), and the problem it is.
MALFORMED: list[tuple[list[bytes], str]] = [
    ([b"", FF8], "start_ahead"),  # the issue: -1 signed, 2**64-1 unsigned
    ([FF8], "start_ahead"),  # the same from a bare DEALER
    ([b"", b"\xff" * 9], "start_size"),
    ([b"", b"\x00" * 7], "start_size"),
    ([b"", b""], "start_size"),
    ([b""], "start_size"),
    ([b"", b"\x00" * MAX_REPLAY_FRAME_BYTES], "start_size"),  # the largest frame accepted
    ([b"", (2**63).to_bytes(8, "big")], "start_ahead"),  # negative if read as signed
    ([b"", (-5).to_bytes(8, "big", signed=True)], "start_ahead"),
    ([b"", (10**12).to_bytes(8, "big")], "start_ahead"),
    ([b"x", bytes(8)], "delimiter"),
    ([b"", b"", bytes(8)], "frame_count"),
    ([b""] * 10, "frame_count"),
    ([bytes(8)] * 5, "frame_count"),
    ([b"junk", b"more", b"\x00"], "frame_count"),
]


@pytest.fixture
def make_publisher() -> Iterator[Factory]:
    with publishers() as factory:
        yield factory


def random_requests(count: int, seed: int = 21) -> list[list[bytes]]:
    """Random frame counts and random bytes, every frame small enough for libzmq to pass."""
    rng = random.Random(seed)
    return [
        [rng.randbytes(rng.choice((0, 1, 7, 8, 9, rng.randrange(65)))) for _ in range(n)]
        for n in (rng.randrange(1, 7) for _ in range(count))
    ]


def spawn_attacker(code: str) -> subprocess.Popen:
    """``code`` (after ``import os, time, zmq``) in a child capped at 1 GiB of address space."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    script = "import os, time, zmq\n" + code
    return subprocess.Popen([sys.executable, "-c", script], preexec_fn=cap)


def assert_end_marker_only(reply: list[list[bytes]] | None, sent: list[bytes]) -> None:
    """One message, the end marker, behind a delimiter if the request had one."""
    assert reply is not None and len(reply) == 1, f"{len(sent)} frames: {reply!r}"
    delimited = len(sent) >= 2 and sent[0] == b""
    assert reply[0] == ([b""] if delimited else []) + [END_SEQ, b""]


def assert_stream_works(pub: KVEventPublisher, name: str) -> None:
    """The thread lives, a new block is published live and an honest replay returns it."""
    assert pub._thread.is_alive() and pub.up
    assert pub_delivers(pub, name)
    assert replay_holds(pub, publish_block(pub, name + "-replay"))
    assert not pub.health_state.failures


def test_the_issue_case_ff_x8_is_answered_and_the_thread_lives(make_publisher: Factory) -> None:
    pub = make_publisher()
    publish_block(pub, "before")
    attacker = dealer(pub.replay_endpoint or "")
    attacker.send_multipart([b"", FF8])
    assert_end_marker_only(answers(attacker), [b"", FF8])
    attacker.close(linger=0)
    assert pub.health_state.rejected["start_ahead"] == 1
    assert_stream_works(pub, "after")


def test_replay_request_fuzz(make_publisher: Factory) -> None:
    pub = make_publisher()
    publish_block(pub, "before")
    attacker = dealer(pub.replay_endpoint or "")
    cases = [frames for frames, _ in MALFORMED] + random_requests(300)
    for frames in cases:
        attacker.send_multipart(frames)
        reply = answers(attacker)
        assert reply is not None and reply[-1][-2:] == [END_SEQ, b""]
    for frames, problem in MALFORMED:  # each listed case gets exactly its answer and count
        before = pub.health_state.rejected[problem]
        attacker.send_multipart(frames)
        assert_end_marker_only(answers(attacker), frames)
        assert pub.health_state.rejected[problem] == before + 1
    attacker.close(linger=0)
    assert sum(pub.health_state.rejected.values()) >= len(MALFORMED) * 2
    assert set(pub.health_state.rejected) <= set(REPLAY_PROBLEMS)
    assert_stream_works(pub, "after-fuzz")


def test_frames_over_the_limit_are_dropped_by_libzmq(make_publisher: Factory) -> None:
    pub = make_publisher()
    publish_block(pub, "before")
    for size in (MAX_REPLAY_FRAME_BYTES + 1, 1 << 20, 8 << 20):
        attacker = dealer(pub.replay_endpoint or "")
        attacker.send_multipart([b"", bytes(size)])
        assert answers(attacker, timeout_s=0.5) is None  # never reached Python: no answer
        attacker.close(linger=0)
    assert not pub.health_state.rejected  # nothing of them was read
    assert_stream_works(pub, "after-big-frames")


def test_a_request_of_many_frames_is_refused_and_publishing_goes_on(
    make_publisher: Factory,
) -> None:
    pub = make_publisher()
    attacker = dealer(pub.replay_endpoint or "")
    frames = [b""] * 200_000
    attacker.send_multipart(frames)
    assert_end_marker_only(answers(attacker, timeout_s=10), frames)
    attacker.close(linger=0)
    assert pub.health_state.rejected == {"frame_count": 1}
    assert_stream_works(pub, "after-many-frames")


def test_a_huge_subscription_is_dropped_by_libzmq(make_publisher: Factory) -> None:
    pub = make_publisher()
    # In a child: libzmq 4.3.5's XSUB itself crashes when closed with such a message pending.
    attacker = spawn_attacker(
        f"x = zmq.Context().socket(zmq.XSUB); x.connect({pub.endpoint!r})\n"
        "x.send(b'\\x01' + b'k' * (8 << 20)); time.sleep(3); os._exit(0)"
    )
    try:
        time.sleep(0.5)
        assert_stream_works(pub, "after-huge-subscription")
    finally:
        attacker.kill()
        attacker.wait(10)


def test_starts_within_the_buffer_are_served(make_publisher: Factory) -> None:
    pub = make_publisher(buffer_batches=4)
    for i in range(6):
        publish_block(pub, f"b{i}")  # seqs 0..5; the buffer keeps 2..5
    client = dealer(pub.replay_endpoint or "")
    for start, expected in ((0, [2, 3, 4, 5]), (4, [4, 5]), (6, [])):
        client.send_multipart([b"", start.to_bytes(8, "big")])
        reply = answers(client)
        assert reply is not None
        assert [int.from_bytes(m[1], "big") for m in reply[:-1]] == expected
    client.send_multipart([b"", (7).to_bytes(8, "big")])  # past the next batch
    assert_end_marker_only(answers(client), [b"", b""])
    client.close(linger=0)
    assert pub.replays_served == 3 and pub.health_state.rejected == {"start_ahead": 1}


@given(st.lists(st.binary(max_size=80), min_size=1, max_size=8))
def test_parse_replay_request_never_raises(frames: list[bytes]) -> None:
    request = parse_replay_request(frames)
    assert request.envelope[0] == frames[0]
    assert request.problem is None or request.problem in REPLAY_PROBLEMS
    if request.problem is None:
        assert len(frames[-1]) == 8 and request.start == int.from_bytes(frames[-1], "big")
        assert request.envelope == frames[:-1]


# --- a peer's group fields --------------------------------------------------------------

D = b"\x11" * 32
# Wrong for group_idx and the window (each reads as absent: group 0, no window); a string is
# a kind (an unknown one is kept), anything else reads as full attention.
BAD_GROUP_VALUES = ["1", -1, True, 1.5, b"\x01", [1], {"a": 1}, None]
GROUP_FIELDS = ("group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
WIRE_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),  # what msgpack can carry
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(0, 9), max_size=2),
)


def _stored_wire(**fields: object) -> list[object]:
    """A BlockStored tagged array of one block with ``fields`` set (vLLM's positions)."""
    values = {"block_hashes": [D], "parent_block_hash": None, "token_ids": [], "block_size": 4}
    values.update(fields)
    return ["BlockStored", *(values.get(name) for name in WIRE_FIELDS["BlockStored"])]


def _as_map(item: list[object]) -> dict[str, object]:
    """A tagged array in the map form."""
    return {"type": item[0], **dict(zip(WIRE_FIELDS[str(item[0])], item[1:], strict=True))}


@pytest.mark.parametrize("value", BAD_GROUP_VALUES, ids=repr)
@pytest.mark.parametrize("form", ["array", "map"])
def test_group_fields_of_the_wrong_type_read_as_absent(value: object, form: str) -> None:
    stored = _stored_wire(**dict.fromkeys(GROUP_FIELDS, value))
    removed = ["BlockRemoved", [D], "cpu", value]
    items = [stored, removed] if form == "array" else [_as_map(stored), _as_map(removed)]
    _, events = decode_batch(msgpack.packb([1.0, items, None]))
    kind = value if isinstance(value, str) else "full_attention"
    assert events == [
        BlockStored([D], None, [], 4, None, None, kv_cache_spec_kind=kind),
        BlockRemoved([D], "cpu"),
    ]


@given(st.fixed_dictionaries({}, optional=dict.fromkeys(GROUP_FIELDS, WIRE_VALUES)))
def test_decoding_group_fields_never_raises(fields: dict[str, object]) -> None:
    removed = ["BlockRemoved", [D], "cpu", fields.get("group_idx")]
    payload = msgpack.packb([1.0, [_stored_wire(**fields), removed], None])
    _, (stored, gone) = decode_batch(payload)
    for event in (stored, gone):
        assert type(event.group_idx) is int and event.group_idx >= 0
    assert isinstance(stored.kv_cache_spec_kind, str)
    window = stored.kv_cache_spec_sliding_window
    assert window is None or (type(window) is int and window >= 1)
