"""Layering: the router and the protocol layer load without torch, the engine or the server."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import prefixcache

PACKAGE = Path(prefixcache.__file__).parent
FORBIDDEN_IN_ROUTER = ("torch", "prefixcache.engine.models", "prefixcache.server.app")
UPPER_LAYERS = ("prefixcache.engine", "prefixcache.server", "prefixcache.router")


def loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(result.stdout.splitlines()[-1]))


PROTOCOL_MODULES = sorted(
    f"prefixcache.protocol.{path.stem}" for path in PACKAGE.glob("protocol/*.py")
)


@pytest.mark.parametrize(
    "modules", [["prefixcache.router.app"], ["prefixcache.router.cli"], PROTOCOL_MODULES]
)
def test_router_and_protocol_import_without_torch_engine_or_server(modules: list[str]) -> None:
    loaded = loaded_after("\n".join(f"import {module}" for module in modules))
    assert set(modules) <= loaded
    assert not loaded & set(FORBIDDEN_IN_ROUTER)
    assert not [m for m in loaded if m.startswith("prefixcache.server")]


def test_the_command_line_imports_no_torch_before_a_command_needs_it() -> None:
    assert not loaded_after("import prefixcache.cli") & set(FORBIDDEN_IN_ROUTER)


def test_top_is_a_client_only() -> None:
    """``prefixcache top`` reads servers over HTTP: no torch, engine, server or router."""
    loaded = loaded_after("import prefixcache.tools.top.render, prefixcache.tools.top.terminal")
    assert "prefixcache.tools.top.watch" in loaded
    upper = ("prefixcache.engine", "prefixcache.server", "prefixcache.router", "torch")
    assert not [m for m in loaded if m.startswith(upper)]


def test_route_loads_its_tokenizer_without_torch() -> None:
    """What ``prefixcache route`` runs for a digest policy: the tokenizer from the GGUF."""
    loaded = loaded_after(
        "from prefixcache.engine.model_files import load_tokenizer\n"
        "assert load_tokenizer().encode('hello world')"
    )
    assert not loaded & set(FORBIDDEN_IN_ROUTER)


def test_explain_reads_a_models_window_without_torch() -> None:
    """What ``prefixcache explain --model M`` runs for the window: the GGUF's metadata only."""
    loaded = loaded_after(
        "from prefixcache.engine.model_files import sliding_window\n"
        "import prefixcache.tools.explain\n"
        "assert sliding_window(None) == 0"
    )
    assert "prefixcache.tools.explain_window" in loaded
    assert not loaded & set(FORBIDDEN_IN_ROUTER)


def imported_names(path: Path) -> list[str]:
    """Every module an ``import``/``from`` statement in ``path`` names (TYPE_CHECKING too)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_protocol_imports_no_upper_layer_and_no_torch() -> None:
    files = sorted((PACKAGE / "protocol").rglob("*.py"))
    assert files
    upward = {
        f"{path.name}: {name}"
        for path in files
        for name in imported_names(path)
        if name == "torch" or name.startswith("torch.") or name.startswith(UPPER_LAYERS)
    }
    assert not upward


def test_the_ray_layer_loads_no_torch_and_the_router_loads_no_ray() -> None:
    """``prefixcache ray``'s deployments supervise servers, they do not hold a model; and
    ``prefixcache route`` stays free of Ray (the ingress runs it as a plain process)."""
    loaded = loaded_after("import prefixcache.on_ray.app\nimport prefixcache.on_ray.cli")
    assert {"prefixcache.on_ray.app", "ray.serve"} <= loaded
    assert not loaded & set(FORBIDDEN_IN_ROUTER)
    assert not [m for m in loaded if m.startswith(("prefixcache.server", "prefixcache.engine"))]
    router = loaded_after("import prefixcache.router.app\nimport prefixcache.router.cli")
    assert not [m for m in router if m == "ray" or m.startswith(("ray.", "prefixcache.on_ray"))]
