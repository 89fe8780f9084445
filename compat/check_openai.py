"""The openai async client: concurrent streams, some cancelled mid-way; then nothing leaks."""

import asyncio
import sys
import urllib.request

from openai import AsyncOpenAI

base_url, model = sys.argv[1], sys.argv[2]
SYSTEM = "You are the help desk of a railway company. Answer briefly. " * 8


async def one(client: AsyncOpenAI, i: int) -> str:
    stream = await client.chat.completions.create(
        model=model, stream=True, max_tokens=48, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Q{i}?"}],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = 0
    async for _ in stream:
        chunks += 1
        if i % 3 == 0 and chunks == 4:
            await stream.close()  # the client walks away mid-stream
            return "cancelled"
    return "done"


async def main() -> None:
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    tasks = [asyncio.create_task(one(client, i)) for i in range(12)]
    await asyncio.sleep(1.0)
    tasks[1].cancel()  # and one task is cancelled outright
    results = await asyncio.gather(*tasks, return_exceptions=True)
    outcomes = ["task-cancelled" if isinstance(r, asyncio.CancelledError) else r for r in results]
    for _ in range(100):  # the server aborts the abandoned requests within a step or two
        metrics = urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics").read().decode()
        running = [ln for ln in metrics.splitlines() if ln.startswith("vllm:num_requests_running")]
        if running and running[0].endswith(" 0.0"):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError(f"requests still running after the clients left: {running}")
    scored = await client.chat.completions.create(
        model=model, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
        messages=[{"role": "user", "content": "Say hi."}],
    )  # fmt: skip
    assert len(scored.choices[0].logprobs.content[0].top_logprobs) == 3
    print(
        f"{outcomes.count('done')} done, {outcomes.count('cancelled')} closed mid-stream, "
        f"{outcomes.count('task-cancelled')} task cancelled; none left running; logprobs ok"
    )


asyncio.run(main())
