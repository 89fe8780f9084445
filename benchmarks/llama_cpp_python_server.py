"""llama-cpp-python's OpenAI server with ggml's extra buffer types off (run by the peer venv).

ggml's AMX matmul (an "extra buffer type", chosen by default on a CPU with AMX) segfaults
on the default GGUF on this machine's CPU at the first forward; without extra buffer types
llama.cpp runs its plain AVX-512 Q4_1/Q8_0 kernels, as `llama-server --no-repack` does.
The server has no flag for it, so this sets it in the bindings' defaults, then runs
`python -m llama_cpp.server` with the same arguments.
"""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    import llama_cpp.llama_cpp as bindings

    defaults = bindings.llama_model_default_params

    def model_params():
        params = defaults()
        params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = model_params
    sys.argv = ["llama_cpp.server", *sys.argv[1:]]
    runpy.run_module("llama_cpp.server", run_name="__main__")


if __name__ == "__main__":
    main()
