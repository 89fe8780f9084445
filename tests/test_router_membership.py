"""The router's replicas file (``--replicas-file``): checked, re-read on change, applied."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from prefixcache.router.forward import response_headers
from prefixcache.router.index import GlobalIndex
from prefixcache.router.membership import (
    MAX_HEADER_VALUE,
    Member,
    MembershipFile,
    parse_members,
    write_members,
)
from prefixcache.router.replicas import Fleet

pytestmark = pytest.mark.quick

NODE = {"x-prefixcache-node": "node-a"}


def test_a_written_list_reads_back_once_and_again_only_after_a_change(tmp_path):
    path = tmp_path / "replicas.json"
    watcher = MembershipFile(path)
    assert watcher.read_if_changed() is None  # not written yet
    write_members(path, [Member("http://127.0.0.1:9001", NODE)])
    assert watcher.read_if_changed() == [Member("http://127.0.0.1:9001", NODE)]
    assert watcher.read_if_changed() is None
    write_members(path, [])
    assert watcher.read_if_changed() == []
    assert not list(tmp_path.glob(".*.tmp"))  # the rename left no temporary behind


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"replicas": "http://a"}, "'replicas' must be a list"),
        ({"replicas": [{"url": 5}]}, "replicas[0].url must be a string"),
        ({"replicas": [{"url": "ftp://a"}]}, "replicas[0].url must be an http(s) URL"),
        ({"replicas": [{"url": "http://a", "headers": {"set-cookie": "x"}}]}, "'set-cookie'"),
        (
            {"replicas": [{"url": "http://a", "headers": {"x-prefixcache-node": "\n"}}]},
            f"at most {MAX_HEADER_VALUE} characters",
        ),
    ],
)
def test_a_bad_list_is_refused_naming_the_field(body, names):
    with pytest.raises(ValueError, match=None) as refused:
        parse_members(json.dumps(body))
    assert names in str(refused.value)


def test_a_refused_file_keeps_the_last_good_list(tmp_path, caplog):
    path = tmp_path / "replicas.json"
    write_members(path, [Member("http://127.0.0.1:9001", {})])
    watcher = MembershipFile(path)
    assert watcher.read_if_changed()
    path.write_text("{not json")
    os.utime(path, ns=(1, 1))
    assert watcher.read_if_changed() is None
    assert "refused, the last list stays" in caplog.text


def test_the_fleet_follows_the_list_and_responses_carry_its_headers(tmp_path):
    index = GlobalIndex()
    fleet = Fleet(["http://127.0.0.1:9001"], index, client=None)
    index.attach("http://127.0.0.1:9001", None)
    fleet.apply_members([Member("http://127.0.0.1:9002", NODE)])
    assert list(fleet.replicas) == ["http://127.0.0.1:9002"]
    assert index.counts("http://127.0.0.1:9001").pool == 0
    upstream = httpx.Response(200, headers={"x-prefixcache-node": "forged", "date": "d"})
    headers = response_headers(upstream, fleet.replicas["http://127.0.0.1:9002"], decoded=True)
    assert headers["x-prefixcache-node"] == "node-a"  # the list's, not the replica's own
    assert headers["x-prefixcache-replica"] == "http://127.0.0.1:9002"
    assert "date" not in headers
