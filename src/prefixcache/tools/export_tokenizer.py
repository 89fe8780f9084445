"""``prefixcache export-tokenizer DIR``: the model's tokenizer as a Hugging Face folder.

For clients that tokenize on their side (lm-evaluation-harness, guidellm): they load
``DIR`` with ``AutoTokenizer`` and get the ids this server computes, from the GGUF itself.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from prefixcache.model_names import MODEL_HELP


def add_export_tokenizer_parser(commands: argparse._SubParsersAction) -> None:
    """The ``export-tokenizer`` subcommand."""
    export = commands.add_parser(
        "export-tokenizer", help="write the model's tokenizer as a Hugging Face folder"
    )
    export.add_argument("dir", type=Path, help="folder to write tokenizer.json and its config to")
    export.add_argument("--model", help=MODEL_HELP)


def run_export_tokenizer(args: argparse.Namespace) -> int:
    """Write the folder; say what was written."""
    from prefixcache.engine.model_files import ModelFileError, load_tokenizer

    try:
        tokenizer = load_tokenizer(args.model)
        written = tokenizer.save_hf(args.dir)
    except (ModelFileError, OSError) as error:
        print(f"prefixcache export-tokenizer: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
