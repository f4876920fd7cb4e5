"""Streaming request functions: OpenAI ``/v1/completions``, ``/v1/chat/completions`` and
SGLang's native ``/generate``. Each sends one request and fills a `RequestRecord` with the
time of every chunk that carried output and the server's token counts."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmark.online.datasets import BenchRequest, Renderer
from benchmark.online.metrics import RequestRecord

BACKENDS = ("completions", "chat", "generate")
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "generate": "/generate"}


@dataclass
class Endpoint:
    base_url: str
    backend: str = "completions"
    model: str = "default"
    prompt_format: str = "ids"  # "ids" (token-id prompts) or "text"
    renderer: Renderer = field(default_factory=Renderer)
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + PATHS[self.backend]


def build_payload(ep: Endpoint, req: BenchRequest) -> dict[str, Any]:
    text = ep.prompt_format == "text" or ep.backend == "chat"
    if ep.backend == "chat":
        messages = [{"role": "user", "content": ep.renderer(req.body)}]
        if req.prefix:
            messages.insert(0, {"role": "system", "content": ep.renderer(req.prefix)})
        body: dict[str, Any] = {"messages": messages}
    elif ep.backend == "completions":
        ids = req.prefix + req.body
        body = {"prompt": ep.renderer(req.prefix) + ep.renderer(req.body) if text else ids}
    else:
        ids = req.prefix + req.body
        key = "text" if text else "input_ids"
        body = {key: ep.renderer(req.prefix) + ep.renderer(req.body) if text else ids}
    if ep.backend == "generate":
        body["sampling_params"] = {
            "max_new_tokens": req.output_len,
            "temperature": ep.temperature,
            "ignore_eos": ep.ignore_eos,
        }
        body["stream"] = True
    else:
        body.update(
            model=ep.model,
            max_tokens=req.output_len,
            temperature=ep.temperature,
            ignore_eos=ep.ignore_eos,
            stream=True,
            # Token counts come from the server's usage, sent in a last chunk.
            stream_options={"include_usage": True},
        )
    return {**body, **ep.extra_body}


def _take_usage(record: RequestRecord, usage: dict[str, Any]) -> None:
    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    record.output_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = int(details.get("cached_tokens") or usage.get("cached_tokens") or 0)


def _has_output(backend: str, event: dict[str, Any], state: dict[str, int]) -> bool:
    """Whether this SSE event carries new output (so its arrival counts as a chunk)."""
    if backend == "generate":
        # /generate events carry everything so far; new output = more output ids.
        n = len(event.get("output_ids") or [])
        grew, state["ids"] = n > state.get("ids", 0), max(n, state.get("ids", 0))
        return grew
    choices = event.get("choices") or []
    if not choices:
        return False
    if backend == "chat":
        delta = choices[0].get("delta") or {}
        return bool(delta.get("content") or delta.get("reasoning_content"))
    return bool(choices[0].get("text"))


_JSON = {"Content-Type": "application/json"}


def encode_payload(ep: Endpoint, req: BenchRequest) -> bytes:
    return json.dumps(build_payload(ep, req)).encode()


async def send_request(
    session: aiohttp.ClientSession, ep: Endpoint, req: BenchRequest, body: bytes | None = None
) -> RequestRecord:
    """One streamed request. ``body``: its JSON, encoded beforehand (see runner.send_all)."""
    record = RequestRecord(expected_output_tokens=req.output_len)
    if body is None:
        body = encode_payload(ep, req)
    state: dict[str, int] = {}
    usage_seen = done = False
    record.start = time.perf_counter()
    try:
        async with session.post(ep.url, data=body, headers=_JSON) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                record.end = time.perf_counter()
                return record
            async for raw in resp.content:
                now = time.perf_counter()
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event and not event.get("choices"):
                    record.error = json.dumps(event["error"])[:500]
                    break
                if _has_output(ep.backend, event, state):
                    record.chunk_times.append(now)
                if event.get("usage"):
                    _take_usage(record, event["usage"])
                    usage_seen = True
                elif ep.backend == "generate" and event.get("meta_info"):
                    _take_usage(record, event["meta_info"])
                    usage_seen = True
            record.end = time.perf_counter()
    except (
        aiohttp.ClientError,
        TimeoutError,
        ValueError,
    ) as exc:  # ValueError: bad JSON, huge line
        record.end = time.perf_counter()
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    if not record.error and not record.chunk_times:
        record.error = "the stream carried no output"
    if not record.error and not done and ep.backend != "generate":
        record.error = "the stream ended without [DONE]"
    if not usage_seen:
        # A server that does not report usage: the chunk count is the best estimate left.
        record.output_tokens = len(record.chunk_times)
        record.prompt_tokens = req.prompt_len
    record.success = not record.error
    return record


async def fetch_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as resp:
        resp.raise_for_status()
        return await resp.json(content_type=None)


async def served_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the server lists (what OpenAI routes expect in ``model``)."""
    try:
        body = await fetch_json(session, base_url.rstrip("/") + "/v1/models")
        return str(body["data"][0]["id"])
    except (aiohttp.ClientError, KeyError, IndexError, TypeError):
        return "default"


async def flush_cache(session: aiohttp.ClientSession, base_url: str) -> bool:
    """POST /flush_cache (SGLang and minisgl); False when the server has no such route."""
    try:
        async with session.post(base_url.rstrip("/") + "/flush_cache") as resp:
            return resp.status == 200
    except aiohttp.ClientError:
        return False
