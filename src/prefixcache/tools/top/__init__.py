"""``prefixcache top [URL]``: a live terminal view of a replica, or of a router and every
replica behind it, refreshed every second
(docs/debugging.md#prefixcache-top-url-a-live-view-of-a-replica-or-a-cluster).

It reads what the servers export (``/metrics``, ``/health``, ``/admin/prefixes``, a router's
``/admin/replicas``) with the admin key where there is a key file; rates over the last
minute are differences between its own scrapes. Digests and counts only, never text.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_URL = "http://127.0.0.1:8000"
KEY_VARIABLE = "PREFIXCACHE_API_KEY"
PLAIN_WIDTH = 132  # columns of a frame printed to a file or pipe


def add_top_parser(commands: argparse._SubParsersAction) -> None:
    """The ``top`` subcommand and its options."""
    parser = commands.add_parser(
        "top", help="live view of a replica, or of a router and its replicas (q quits)"
    )
    parser.add_argument(
        "url", nargs="?", default=DEFAULT_URL, help=f"a replica or router (default {DEFAULT_URL})"
    )
    add_key_option(parser)
    parser.add_argument(
        "--interval", type=float, default=1.0, metavar="SECONDS", help="seconds between refreshes"
    )
    parser.add_argument(
        "--once", action="store_true", help="print one frame and exit (also when not a terminal)"
    )


def add_key_option(parser: argparse.ArgumentParser) -> None:
    """``--api-key KEY``: an admin's key (``top`` and ``explain --served``)."""
    parser.add_argument(
        "--api-key",
        "--key",
        dest="api_key",
        metavar="KEY",
        help=f"an admin tenant's key, where the server has a key file (default: ${KEY_VARIABLE})",
    )


def admin_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else ``$PREFIXCACHE_API_KEY``; None: no key."""
    return args.api_key or os.environ.get(KEY_VARIABLE) or None


def with_scheme(url: str) -> str:
    """``host:port`` as ``http://host:port``; a URL with a scheme as it is."""
    return url if "://" in url else f"http://{url}"


def run_top(args: argparse.Namespace) -> int:
    """The view until ``q`` or Ctrl-C (0); 2 with one line if the URL or key is refused."""
    from rich.console import Console

    from prefixcache.tools.top.render import render
    from prefixcache.tools.top.scrape import Client, TopError
    from prefixcache.tools.top.watch import Watch

    if not args.interval > 0:
        print(f"prefixcache top: --interval {args.interval} must be > 0", file=sys.stderr)
        return 2
    client = Client(admin_key(args), timeout=min(2.0, max(0.5, args.interval)))
    url = with_scheme(args.url)
    watch = Watch(client, url)
    try:
        watch.start()
        live = not args.once and sys.stdin.isatty() and sys.stdout.isatty()
        if not live:
            Console(width=_plain_width()).print(render(watch.tick(), args.interval))
            return 0
        from prefixcache.tools.top.terminal import run_live

        run_live(lambda: render(watch.tick(), args.interval), args.interval, Console())
        return 0
    except TopError as error:
        print(f"prefixcache top: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        watch.close()
        client.close()


def _plain_width() -> int:
    """A frame's width off a terminal: ``COLUMNS`` if set, else wide enough for the tables."""
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else PLAIN_WIDTH
