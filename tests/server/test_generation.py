"""Generation: the streams one engine step finishes write their last tokens before any of them completes."""

import asyncio
import time

from mlaserve.engine.core_output import CoreOutput
from mlaserve.engine.intake import PreparedRequest
from mlaserve.engine.output_stream import OutputStream
from mlaserve.sampling_params import SamplingParams
from mlaserve.server.generation import Generation
from mlaserve.server.metrics import ServerMetrics


class _Engine:
    """What Generation needs of an engine: submit, giving a stream the test delivers to."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.streams = loop, []

    def submit(self, prepared: list, request_ids: list[str]) -> OutputStream:
        stream = OutputStream(request_ids, self.loop, lambda *args, **kwargs: None)
        self.streams.append(stream)
        return stream


def test_every_finished_stream_gets_its_last_tokens_before_any_completes() -> None:
    async def run() -> list[tuple[str, int]]:
        engine = _Engine(asyncio.get_running_loop())
        metrics = ServerMetrics(dict, lambda: True)
        prepared = [PreparedRequest(None, [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))]
        gens = [
            Generation(engine, metrics, prepared, f"req-{i}", 3, timeout_s=60.0, arrival=time.monotonic())
            for i in range(4)
        ]
        log: list[tuple[str, int]] = []

        async def consume(i: int, gen: Generation) -> None:
            async for batch in gen.updates():
                log.append(("tokens", i) if batch[0].finish_reason else ("first", i))
            log.append(("completion", i))  # usage, [DONE] and the response's end come here

        readers = [asyncio.create_task(consume(i, g)) for i, g in enumerate(gens)]
        await asyncio.sleep(0)
        for stream in engine.streams:  # one step: a token for every stream
            stream.deliver([CoreOutput(stream.request_ids[0], [8])], None)
        await asyncio.sleep(0.01)
        for stream in engine.streams:  # the next step finishes them all at once
            stream.deliver([CoreOutput(stream.request_ids[0], [9], finish_reason="length")], None)
        await asyncio.gather(*readers)
        return log

    log = asyncio.run(run())
    last_tokens = [k for k, (event, _) in enumerate(log) if event == "tokens"]
    completions = [k for k, (event, _) in enumerate(log) if event == "completion"]
    assert len(last_tokens) == len(completions) == 4
    assert max(last_tokens) < min(completions), log
