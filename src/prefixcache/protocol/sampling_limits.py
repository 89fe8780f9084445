"""The ranges of sampling parameters: checked by ``SamplingParams`` and by the request schemas.

One home, so the engine and the HTTP layers (server and router) accept exactly the same values.
"""

MAX_N = 16  # completions per request
MAX_TEMPERATURE = 2.0  # OpenAI's range; hotter is noise
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_SEED = 2**63 - 1
MIN_REQUEST_SEED = -(2**63)  # a client's seed may be any int64 or uint64 (see fold_seed)
MAX_REQUEST_SEED = 2**64 - 1
MAX_PENALTY = 2.0  # presence/frequency penalty range [-2, 2], OpenAI's
MAX_REPETITION_PENALTY = 10.0  # (0, 10]; 1 is off
MAX_LOGIT_BIAS = 100.0  # bias values in [-100, 100], OpenAI's
MAX_LOGIT_BIAS_TOKENS = 300  # entries in one logit_bias map
MAX_LOGPROBS = 20  # top logprobs per token (generated or prompt), OpenAI chat's limit
# Nearer 0 these overflow or round to 0 in float32: NaN scores would fail the whole step.
MIN_TEMPERATURE = 1e-6  # unless exactly 0 (greedy)
MIN_TOP_P = 1e-6
MIN_REPETITION_PENALTY = 0.01
