"""Samples to one SGLang server, batched: what is submitted in one turn of the event loop goes as
one ``POST /generate``.

SGLang's HTTP front end handles requests one after another, at a cost of a few milliseconds each:
64 prompts sent one by one reach the scheduler over tens of milliseconds, start staggered, and the
last finishes that much later (10% of a 1.7B rollout on an H200); 512 short samples spend seconds
there. A batch is parsed once and scheduled together.

A batch is **streamed** (``stream: true``) with a stream interval past any budget, so that the
server sends each sample twice, after its first token and when it finishes, and each sample is
answered when it finishes, not when the batch does (partial rollout and asynchronous training
consume samples as they come). The finishing chunk carries all of the sample's tokens and
log-probs (SGLang's streams are cumulative unless ``--incremental-streaming-output``).

SGLang checks a batch's samples in turn and fails the whole stream at the first bad one (and
aborts the rest of the batch): samples left unanswered then go again one by one, so a bad sample
fails alone. Every post gives a sample a fresh request id (``<base><serial>#``): SGLang aborts
every request whose id *starts with* the one named, so ids must be prefix-free, and an id reused
right after an abort could meet the old request's state.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable
from typing import Any

_ONLY_AT_THE_END = 1 << 30  # stream interval: a chunk after the first token and one at the finish
_MAX_BATCH = 1024


class SGLangError(RuntimeError):
    """The server refused or failed a call (its own message follows)."""


def request_id_base(request_id: str, k: int) -> str:
    """The prefix-free start of sample ``k``'s server ids: ``%`` and ``#`` escaped, fields ``#``-ended."""
    return f"{request_id.replace('%', '%25').replace('#', '%23')}#{k}#"


class Sample:
    """One sample as the server knows it: its request body and the future of its answer."""

    __slots__ = ("base", "body", "answer", "prefix")

    def __init__(self, base: str, body: dict[str, Any], prefix: str):
        self.base, self.body, self.prefix = base, body, prefix
        self.answer: asyncio.Future = asyncio.get_running_loop().create_future()

    @property
    def rid(self) -> str:
        return self.body["rid"]

    def settle(self, answer: dict[str, Any] | None = None, error: BaseException | None = None) -> None:
        if not self.answer.done():  # its caller may have gone
            if error is not None:
                self.answer.set_exception(error)
            else:
                self.answer.set_result(answer)


class Dispatcher:
    """Sends submitted samples, batching those of one event-loop turn.

    ``client``: an ``httpx.AsyncClient`` on the server, of the loop the dispatcher runs on;
    ``lost(what)``: the error for a server that did not answer.
    """

    def __init__(self, client: Any, lost: Callable[[str], BaseException]):
        self._client, self._lost = client, lost
        self._queue: list[Sample] = []
        self._flush_scheduled = False
        self._serial = itertools.count()
        self._posts: set[asyncio.Task] = set()  # held: the loop keeps only weak references

    def submit(self, sample: Sample) -> asyncio.Future:
        self._queue.append(sample)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        return sample.answer

    def _flush(self) -> None:
        self._flush_scheduled = False
        queue, self._queue = [s for s in self._queue if not s.answer.done()], []
        for start in range(0, len(queue), _MAX_BATCH):
            batch = queue[start : start + _MAX_BATCH]
            post = asyncio.ensure_future(self._alone(batch[0]) if len(batch) == 1 else self._together(batch))
            self._posts.add(post)
            post.add_done_callback(self._posts.discard)

    def _name(self, sample: Sample) -> None:
        sample.body["rid"] = f"{sample.base}{next(self._serial)}#"

    async def _alone(self, sample: Sample) -> None:
        import httpx

        self._name(sample)
        try:
            response = await self._client.post("/generate", json=sample.body)
        except httpx.HTTPError as exc:
            return sample.settle(error=self._lost(f"POST /generate failed ({type(exc).__name__}: {exc})"))
        if response.status_code == 400:  # a bad request fails alone
            return sample.settle(error=ValueError(sample.prefix + f"sglang refused it: {message(response)}"))
        if response.status_code != 200:
            return sample.settle(
                error=SGLangError(sample.prefix + f"sglang answered {response.status_code}: {message(response)}")
            )
        sample.settle(response.json())

    async def _together(self, samples: list[Sample]) -> None:
        import httpx

        for sample in samples:
            self._name(sample)
        body = {
            "input_ids": [s.body["input_ids"] for s in samples],
            "rid": [s.rid for s in samples],
            "sampling_params": [{**s.body["sampling_params"], "stream_interval": _ONLY_AT_THE_END} for s in samples],
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": True,
            **({"return_routed_experts": True} if samples[0].body.get("return_routed_experts") else {}),
        }
        try:
            async with self._client.stream("POST", "/generate", json=body) as response:
                if response.status_code == 200:
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        chunk = json.loads(data)
                        # a finished sample (its first token is sent too); an error ends the stream
                        if "index" in chunk and (chunk.get("meta_info") or {}).get("finish_reason"):
                            samples[chunk["index"]].settle(chunk)
                else:
                    await response.aread()
        except httpx.HTTPError as exc:
            lost = self._lost(f"POST /generate failed ({type(exc).__name__}: {exc})")
            for sample in samples:
                sample.settle(error=lost)
            return
        # refused, or cut short by a bad sample: the unanswered go again alone (the bad one fails)
        await asyncio.gather(*(self._alone(s) for s in samples if not s.answer.done()))


def message(response: Any) -> str:
    """The error message of an SGLang answer."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:300]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])[:300]
        if "message" in body:
            return str(body["message"])[:300]
    return json.dumps(body)[:300]
