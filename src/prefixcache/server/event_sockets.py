"""The KV-event publisher's sockets: loopback-only binds, and bounds on what a peer may send.

Neither socket expects more than a few bytes from a peer (a subscription, a replay request),
so libzmq is told to drop a connection whose frame is larger (``MAXMSGSIZE``) before it
reaches Python, and to queue only a few requests per peer (``RCVHWM``).
"""

from __future__ import annotations

import zmq

from prefixcache.protocol.event_flags import is_loopback_endpoint
from prefixcache.protocol.kv_events import MAX_REPLAY_FRAME_BYTES

ALLOW_REMOTE_FLAG = "--kv-events-allow-remote"
PUB_HWM = 100_000  # messages queued per subscriber before ZMQ drops (vLLM's default)
MAX_SUBSCRIPTION_BYTES = 4096  # a SUB's subscribe message: one byte plus a topic prefix
REPLAY_RCVHWM = 64  # replay requests queued per peer before libzmq stops reading it


def check_bind_allowed(endpoint: str, allow_remote: bool) -> None:
    """Refuse a non-loopback bind unless the operator opted in."""
    if allow_remote or is_loopback_endpoint(endpoint):
        return
    raise ValueError(
        f"refusing to bind KV events to {endpoint!r}: not a loopback address, and the "
        f"events tell anyone who connects what is cached; pass {ALLOW_REMOTE_FLAG} "
        "(allow_remote=True) to publish beyond this machine"
    )


def bind_pub(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """The PUB socket; a peer's subscription larger than a topic drops its connection."""
    return _bind(ctx, zmq.PUB, endpoint, PUB_HWM, MAX_SUBSCRIPTION_BYTES, PUB_HWM)


def bind_replay(ctx: zmq.Context, endpoint: str, buffer_batches: int) -> zmq.Socket:
    """The ROUTER replay socket; a frame over 64 bytes drops the connection that sent it."""
    # One full replay must fit in a client's pipe, or ROUTER drops the tail.
    send_hwm = buffer_batches + 16
    return _bind(ctx, zmq.ROUTER, endpoint, send_hwm, MAX_REPLAY_FRAME_BYTES, REPLAY_RCVHWM)


def _bind(
    ctx: zmq.Context, kind: int, endpoint: str, send_hwm: int, max_frame: int, recv_hwm: int
) -> zmq.Socket:
    """A socket of ``kind`` bound to ``endpoint`` (``tcp://127.0.0.1:*`` picks a port)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, send_hwm)
    sock.setsockopt(zmq.RCVHWM, recv_hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    sock.setsockopt(zmq.LINGER, 0)
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock
