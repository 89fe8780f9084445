"""``GET`` and ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``: a
tenant's stored responses read back, listed and forgotten, in OpenAI's shapes.

Only the caller's tenant's store is read (``TenantResponses``): another tenant's id is a
404 worded exactly as an unknown one. Ids and texts are never logged.
"""

from __future__ import annotations

from collections.abc import Mapping

from prefixcache.protocol.errors import ApiError
from prefixcache.protocol.query import query_limit
from prefixcache.server.response_store import Stored, TenantResponses

MAX_PAGE = 100  # input items per page (OpenAI's bound)
DEFAULT_PAGE = 20
ORDERS = ("asc", "desc")


def retrieve(view: TenantResponses, response_id: str, query: Mapping[str, str]) -> dict:
    """The response object as it was answered."""
    if query.get("stream", "false").lower() not in ("false", "0", ""):
        raise ApiError(400, "stream: a stored response is sent whole, not streamed", "stream")
    return _stored(view, response_id).response


def delete(view: TenantResponses, response_id: str) -> dict:
    """Forget the response (a later ``previous_response_id`` naming it is a 404)."""
    if not view.delete(response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def input_items(view: TenantResponses, response_id: str, query: Mapping[str, str]) -> dict:
    """A page of the response's own input items: ``limit`` (1 to 100), ``order`` (``desc``
    by default, as OpenAI's), after the item ``after``."""
    limit = query_limit(query.get("limit"), DEFAULT_PAGE, MAX_PAGE)
    order = query.get("order", "desc")
    if order not in ORDERS:
        raise ApiError(400, f"order: must be one of {', '.join(ORDERS)}", "order")
    items = list(_stored(view, response_id).input_items)
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ApiError(400, "after: no input item of this response has that id", "after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


def not_found(response_id: str) -> ApiError:
    """The one 404 for an id this tenant has no live response of."""
    return ApiError(404, f"no stored response with id {response_id[:80]!r}", "response_id")


def _stored(view: TenantResponses, response_id: str) -> Stored:
    stored = view.get(response_id)
    if stored is None:
        raise not_found(response_id)
    return stored
