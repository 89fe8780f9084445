"""KV events in vLLM's two forms (tagged arrays, tagged maps) and under a fixed topic, over
real ZMQ on 127.0.0.1, read by the README's reader, vLLM's msgspec structs and our subscriber."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

import loopback
from event_fixtures import digest, publishers, wait_for
from prefixcache.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefixcache.cli import build_parser
from prefixcache.protocol.event_subscriber import KVEventSubscriber
from prefixcache.protocol.kv_events import MAX_TOPIC_CHARS, decode_batch, encode_batch
from prefixcache.server.events import KVEventPublisher

README = Path(__file__).resolve().parents[1] / "README.md"
LLM_D_TOPIC = "kv@pod-a@tiny"
D = [digest("forms", i) for i in range(4)]
# A round of what a replica with a disk tier sends: pool and tier stores, tier and pool removals.
ROUND: list[KVEvent] = [
    BlockStored([D[0], D[1]], None, [], 4, None, "cpu", "bfloat16"),
    BlockStored([D[2]], None, [], 4, None, "disk", "bfloat16"),
    BlockRemoved([D[2]], "disk"),
    BlockRemoved([D[1]], "cpu"),
    AllBlocksCleared(),
]
# Newer vLLM's fields after lora_name, as a pool's full-attention group has them.
NEWER_VLLM = {
    "extra_keys": None,
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
    "kv_cache_spec_sliding_window": None,
}
# The same round as vLLM names its fields (the map form's keys, the array form's positions).
ROUND_AS_VLLM: list[dict[str, Any]] = [
    {"type": "BlockStored", "block_hashes": [D[0], D[1]], "parent_block_hash": None,
     "token_ids": [], "block_size": 4, "lora_id": None, "medium": "cpu", "lora_name": None,
     **NEWER_VLLM, "kv_cache_dtype": "bfloat16"},
    {"type": "BlockStored", "block_hashes": [D[2]], "parent_block_hash": None,
     "token_ids": [], "block_size": 4, "lora_id": None, "medium": "disk", "lora_name": None,
     **NEWER_VLLM, "kv_cache_dtype": "bfloat16"},
    {"type": "BlockRemoved", "block_hashes": [D[2]], "medium": "disk", "group_idx": 0},
    {"type": "BlockRemoved", "block_hashes": [D[1]], "medium": "cpu", "group_idx": 0},
    {"type": "AllBlocksCleared"},
]  # fmt: skip


def readme_reader() -> Callable[..., list[tuple[str, int, dict[str, Any]]]]:
    """The README's ``read_events``, run as written there."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    (code,) = [block for block in blocks if "def read_events" in block]
    namespace: dict[str, Any] = {}
    exec(compile(code, str(README), "exec"), namespace)
    return namespace["read_events"]


def read_while_publishing(
    pub: KVEventPublisher, topic: bytes, batches: int
) -> list[tuple[str, int, dict[str, Any]]]:
    """The README reader in a thread; ``ROUND`` published until it has its batches."""
    read_events, got = readme_reader(), []
    reader = threading.Thread(
        target=lambda: got.extend(read_events(pub.endpoint, topic, batches, 5000))
    )
    reader.start()
    for _ in range(2000):  # a SUB joins after a moment: keep publishing until it has read
        for event in ROUND:
            pub.publish(event)
        reader.join(0.01)
        if not reader.is_alive():
            break
    reader.join(5)
    assert got, "the reader received nothing"
    return got


@pytest.fixture
def make_publisher() -> Iterator[Callable[..., KVEventPublisher]]:
    with publishers() as factory:
        yield factory


def test_both_forms_carry_the_same_events_with_vllms_names_and_positions() -> None:
    array = msgpack.unpackb(encode_batch(1.5, ROUND, 0, "array"))
    mapped = msgpack.unpackb(encode_batch(1.5, ROUND, 0, "map"))
    assert array[0] == mapped[0] == 1.5 and array[2] == mapped[2] == 0  # [ts, events, rank]
    assert mapped[1] == ROUND_AS_VLLM
    assert array[1] == [list(e.values()) for e in ROUND_AS_VLLM]  # vLLM's field order
    for form in ("array", "map"):
        assert decode_batch(encode_batch(1.5, ROUND, None, form)) == (1.5, ROUND)
    with pytest.raises(ValueError, match="array, map"):
        encode_batch(1.5, ROUND, None, "json")


# A hybrid pool's round: the full group and a window group (group_idx 1, 512 tokens).
HYBRID_ROUND: list[KVEvent] = [
    BlockStored([D[0], D[1]], None, [], 4, None, "cpu", "int8"),
    BlockStored([D[0], D[1]], None, [], 4, None, "cpu", "int8", 1, "sliding_window", 512),
    BlockRemoved([D[0]], "cpu", 1),
    BlockRemoved([D[1]], "cpu", 0),
]


@pytest.mark.parametrize("wire_format", ["array", "map"])
def test_group_fields_round_trip_in_either_form_at_vllms_positions(wire_format: str) -> None:
    assert decode_batch(encode_batch(3.0, HYBRID_ROUND, None, wire_format)) == (3.0, HYBRID_ROUND)
    _, items, _ = msgpack.unpackb(encode_batch(3.0, HYBRID_ROUND, None, wire_format))
    if wire_format == "array":  # vLLM's order: ... group_idx, kind, window; then our dtype
        assert items[1][9:] == [1, "sliding_window", 512, "int8"]
        assert items[2] == ["BlockRemoved", [D[0]], "cpu", 1]
    else:
        assert items[1]["group_idx"] == 1 and items[1]["kv_cache_spec_sliding_window"] == 512
        assert items[2] == {"type": "BlockRemoved", "block_hashes": [D[0]], "medium": "cpu",
                            "group_idx": 1}  # fmt: skip


def test_an_older_vllms_events_without_group_fields_are_the_full_group() -> None:
    """vLLM before groups: no trailing fields, or nil ones; BlockRemoved of two fields."""
    older = msgpack.packb(
        [1.0, [["BlockStored", [D[0]], None, [], 16, None, "GPU", None],
               ["BlockStored", [D[1]], D[0], [], 16, None, "GPU", None, None, None, None, None],
               ["BlockRemoved", [D[0]], "GPU"],
               {"type": "BlockRemoved", "block_hashes": [D[1]], "medium": "GPU",
                "group_idx": None}], None]
    )  # fmt: skip
    _, events = decode_batch(older)
    assert events == [
        BlockStored([D[0]], None, [], 16, None, "GPU"),
        BlockStored([D[1]], D[0], [], 16, None, "GPU"),
        BlockRemoved([D[0]], "GPU"),
        BlockRemoved([D[1]], "GPU"),
    ]


def test_vllms_msgspec_structs_without_array_like_decode_the_map_form() -> None:
    """The newer vLLM (and TensorRT-LLM) event structs: tagged maps in a positional batch."""
    import msgspec

    class Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(Event):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(Event):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(Event):
        pass

    fields = [("ts", float), ("events", list[BlockStored | BlockRemoved | AllBlocksCleared])]
    fields.append(("data_parallel_rank", int | None, None))  # type: ignore[arg-type]
    batch_type = msgspec.defstruct("Batch", fields, array_like=True, omit_defaults=True)
    batch = msgspec.msgpack.Decoder(batch_type).decode(encode_batch(2.0, ROUND, None, "map"))
    as_dicts = [msgspec.to_builtins(e, builtin_types=(bytes,)) for e in batch.events]
    # vLLM's struct has no kv_cache_dtype (ours): it reads the rest, and drops nil defaults
    vllms = [
        {
            k: v
            for k, v in e.items()
            if k not in ("kv_cache_dtype", "extra_keys", "kv_cache_spec_sliding_window")
        }
        for e in ROUND_AS_VLLM
    ]
    assert as_dicts == vllms
    assert [e.medium for e in batch.events[:4]] == ["cpu", "disk", "disk", "cpu"]


@pytest.mark.parametrize("wire_format", ["array", "map"])
def test_the_readme_reader_reads_either_form_under_llm_ds_topic(
    make_publisher: Callable[..., KVEventPublisher], wire_format: str
) -> None:
    pub = make_publisher(topic=LLM_D_TOPIC, wire_format=wire_format)
    assert pub.topic == LLM_D_TOPIC and pub.health()["format"] == wire_format
    got = read_while_publishing(pub, b"kv@", batches=6)
    for topic, _, _ in got:  # as llm-d's reader takes its topic apart
        prefix, pod, model = topic.split("@")
        assert (prefix, pod, model) == ("kv", "pod-a", "tiny")
    seqs = [seq for _, seq, _ in got]
    assert seqs == sorted(seqs)
    events = [event for _, _, event in got]
    assert all(event in ROUND_AS_VLLM for event in events)
    assert all(event in events for event in ROUND_AS_VLLM)  # six batches hold a whole round


@pytest.mark.parametrize("wire_format", ["array", "map"])
def test_our_subscriber_reads_either_form_in_order(
    make_publisher: Callable[..., KVEventPublisher], wire_format: str
) -> None:
    pub = make_publisher(topic=LLM_D_TOPIC, wire_format=wire_format)
    for event in ROUND:
        pub.publish(event)
    wait_for(lambda: pub.events_sent == len(ROUND), "the round to go out")
    nudge = BlockRemoved([digest("nudge")], "cpu")
    got: list[KVEvent] = []
    with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, b"kv@") as sub:
        for _ in range(500):  # once a live batch arrives, replay fills in from seq 0
            pub.publish(nudge)
            got += [e for _, _, events in sub.poll(20) for e in events]
            if len(got) >= len(ROUND):
                break
        assert sub.malformed == 0
    assert got[: len(ROUND)] == ROUND and set(map(repr, got[len(ROUND) :])) <= {repr(nudge)}


def test_a_malformed_map_event_is_a_lost_batch_and_reading_goes_on() -> None:
    bad = msgpack.packb([1.0, [{"type": "BlockStored", "medium": "cpu"}], None])
    with pytest.raises(TypeError):
        decode_batch(bad)  # a BlockStored without its hashes
    good = encode_batch(1.0, ROUND[:1], None, "map")
    pub = zmq.Context.instance().socket(zmq.PUB)  # a peer of our own: it sends the bad batch
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    got: list[KVEvent] = []
    try:
        endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        with KVEventSubscriber(endpoint, None, b"kv@", catch_up=False) as sub:
            for seq in range(0, 1000, 2):
                pub.send_multipart([LLM_D_TOPIC.encode(), seq.to_bytes(8, "big"), bad])
                pub.send_multipart([LLM_D_TOPIC.encode(), (seq + 1).to_bytes(8, "big"), good])
                got += [e for _, _, events in sub.poll(20) for e in events]
                if got and sub.malformed:
                    break
            assert sub.malformed >= 1 and sub.batches_lost >= 1
    finally:
        pub.close(linger=0)
    assert got and all(event == ROUND[0] for event in got)


# --- flags ------------------------------------------------------------------------------


def parse_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_bad_format_and_topic_flags_are_clear_errors(capsys) -> None:
    err = parse_error(capsys, "serve", "--kv-events-format", "json")
    assert "--kv-events-format" in err and "'array', 'map'" in err
    err = parse_error(capsys, "serve", "--kv-events-topic", "k" * (MAX_TOPIC_CHARS + 1))
    assert "--kv-events-topic" in err and f"1 to {MAX_TOPIC_CHARS} printable" in err
    assert "got 257 characters" in err
    err = parse_error(capsys, "cluster", "--kv-events-topic", "kv@pod\n@model")
    assert "--kv-events-topic" in err and "not all printable" in err
    err = parse_error(capsys, "serve", "--kv-events-topic", "")
    assert "--kv-events-topic" in err and "got 0 characters" in err
    args = build_parser().parse_args(["serve", "--kv-events-topic", "k" * MAX_TOPIC_CHARS])
    assert args.kv_events_topic == "k" * MAX_TOPIC_CHARS and args.kv_events_format == "array"


def test_the_cluster_passes_format_and_topic_to_every_replica(tmp_path) -> None:
    from prefixcache.router.cluster import plan_cluster

    argv = ["cluster", "--kv-events-format", "map", "--kv-events-topic", LLM_D_TOPIC]
    plan = plan_cluster(build_parser().parse_args(argv), tmp_path)
    for replica in plan.replicas:
        command = replica.command
        assert command[command.index("--kv-events-format") + 1] == "map"
        assert command[command.index("--kv-events-topic") + 1] == LLM_D_TOPIC
        assert build_parser().parse_args(command[3:]).kv_events_format == "map"
    plan = plan_cluster(build_parser().parse_args(["cluster"]), tmp_path)
    assert "--kv-events-topic" not in plan.replicas[0].command


# --- a real `prefixcache serve` ---------------------------------------------------------


def test_a_real_server_publishes_the_map_form_under_its_topic_with_tier_media(tmp_path) -> None:
    """The README's map-form command (tiny model, a disk tier): pool and tier stores arrive."""

    from router_fixtures import ReplicaProcess, write_tiny_hf_model

    flags = ("--kv-events-format", "map", "--kv-events-topic", LLM_D_TOPIC)
    tier = ("--kv-tier", f"disk:{tmp_path / 'tier'}")
    server = ReplicaProcess(write_tiny_hf_model(tmp_path / "tiny"), tmp_path, flags + tier)
    read_events, got = readme_reader(), []
    try:
        health = server.start().wait_ready()["kv_events"]
        assert (health["topic"], health["format"]) == (LLM_D_TOPIC, "map")
        endpoint = f"tcp://127.0.0.1:{server.events_port}"
        reader = threading.Thread(target=lambda: got.extend(read_events(endpoint, b"kv@", 12)))
        reader.start()
        for attempt in range(40):  # until the reader has its batches (a SUB joins late)
            words = " ".join(f"w{attempt}x{i}" for i in range(24))
            body = {"model": "tiny", "messages": [{"role": "user", "content": words}]}
            response = loopback.post(
                f"{server.url}/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=30
            )
            assert response.status_code == 200, response.text
            reader.join(0.2)
            if not reader.is_alive():
                break
        reader.join(15)
    finally:
        server.stop()
    assert got and {topic for topic, _, _ in got} == {LLM_D_TOPIC}
    stored = [event for _, _, event in got if event["type"] == "BlockStored"]
    assert {event["medium"] for event in stored} == {"cpu", "disk"}
    assert all(event["token_ids"] == [] for event in stored)  # opt-in only
    assert all(len(h) == 32 for event in stored for h in event["block_hashes"])
