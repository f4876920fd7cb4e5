"""SGLang-native routes: POST /generate, /abort_request, /flush_cache, /server_info and
/model_info (and their /get_ names), /debug/integrity."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

import minisgl
from minisgl.ipc.messages import ControlReply, JSONDict, SubmitItem, TextOutput
from minisgl.server.errors import APIError, ServiceUnavailable, bad_request
from minisgl.server.native_protocol import GenerateRequest
from minisgl.server.reports import usage_reports
from minisgl.server.request_group import RequestGroup, SequenceResult
from minisgl.server.state import ServerState, server_state
from minisgl.server.streaming import respond, sse, sse_stream

router = APIRouter()

IDLE_WAIT_S = 60.0  # control requests that need an idle scheduler wait at most this long


def finish_reason(r: SequenceResult) -> JSONDict | None:
    if r.finish_reason is None:
        return None
    if r.finish_reason == "stop":
        return {"type": "stop", "matched": r.matched_stop}
    if r.finish_reason == "length":
        return {"type": "length", "length": r.completion_tokens}
    return {"type": "abort", "message": r.error or "aborted"}


def _item(rid: str, r: SequenceResult, arrival: float, with_logprobs: bool) -> JSONDict:
    meta: JSONDict = {
        "id": rid,
        "finish_reason": finish_reason(r),
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
        "e2e_latency": time.perf_counter() - arrival,
    }
    for report in usage_reports([r.counters]):
        meta.update(report.meta_info)
    if with_logprobs:
        meta["output_token_logprobs"] = [[e.logprob, e.token_id, e.token] for e in r.logprobs]
        meta["output_top_logprobs"] = [
            [[t.logprob, t.token_id, t.token] for t in e.top] for e in r.logprobs
        ]
    return {"text": r.text, "output_ids": r.token_ids, "meta_info": meta}


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Response:
    state = server_state(request)
    try:
        prompts, is_batch = body.prompts()
        params = body.to_sampling_params()
    except ValueError as exc:
        raise bad_request(exc) from None
    base = body.rid or uuid.uuid4().hex
    group = state.submit(prompts, params, SubmitItem(0, priority=body.priority or 0), base)
    ids = [base] if len(group.rids) == 1 else [f"{base}-{i}" for i in range(len(group.rids))]
    single = not is_batch and params.n == 1

    def full(results: list[SequenceResult]) -> object:
        items = [
            _item(ids[i], r, group.arrival, body.return_logprob) for i, r in enumerate(results)
        ]
        return items[0] if single else items

    async def stream(group: RequestGroup, first: TextOutput) -> AsyncIterator[str]:
        # Like SGLang: each event carries the text and output ids so far, not a delta.
        results = [SequenceResult() for _ in group.rids]

        def render(i: int, out: TextOutput | None = None) -> str:
            event = _item(ids[i], results[i], group.arrival, body.return_logprob)
            return sse(event if single else {**event, "index": i})

        def render_abort(j: int, error: str) -> str:
            results[j].finish_reason, results[j].error = "abort", error
            return render(j)

        async for data in sse_stream(group, first, results, render, render_abort):
            yield data

    return await respond(request, group, body.stream, stream, full)


async def _control(state: ServerState, kind: str, timeout: float) -> ControlReply:
    try:
        return await state.frontend.control(kind, timeout)
    except asyncio.TimeoutError:
        raise APIError(
            503, f"the scheduler did not answer {kind!r} within {timeout:.0f}s"
        ) from None
    except ServiceUnavailable as exc:
        raise APIError(503, f"the engine is not available: {exc}") from None


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rid: str | None = None
    abort_all: bool = False


@router.post("/abort_request")
async def abort_request(body: AbortRequest, request: Request) -> Response:
    """SGLang's route: abort one request, by the id its response carries (the ``rid`` of
    /generate, the ``id`` of an OpenAI completion), or every one (``abort_all``). The
    sequences end with finish_reason "abort" and what they had generated; their KV is freed."""
    state = server_state(request)
    if body.abort_all:
        n = state.frontend.abort_all(None, 200)
    elif body.rid:
        n = state.frontend.abort_named(body.rid)
    else:
        raise bad_request("rid must be given, or abort_all true")
    state.frontend.observers.on_aborted("abort_request", n)
    return JSONResponse({"success": True, "aborted": n})


# Two registrations, not one api_route with both methods: each gets its own OpenAPI operation
# id (a shared id makes the schema invalid for client generators and fuzzers).
@router.get("/flush_cache")
@router.post("/flush_cache")
async def flush_cache(request: Request) -> Response:
    """Drop the prefix cache (waits until no request is running)."""
    reply = await _control(server_state(request), "flush_cache", IDLE_WAIT_S)
    if not reply.ok:
        raise APIError(400, "cache not flushed: requests are still running")
    return JSONResponse({"success": True, "message": "Cache flushed."})


@router.get("/debug/integrity")
async def integrity(request: Request) -> Response:
    """Run the scheduler's KV integrity check once it is idle; report it with the counts of
    live requests in every process (all zero when nothing leaked)."""
    state = server_state(request)
    reply = await _control(state, "integrity", IDLE_WAIT_S)
    data = dict(reply.data)
    data["api_live_requests"] = state.frontend.num_live_requests
    return JSONResponse(data, status_code=200 if reply.ok else 500)


# SGLang's routers (sglang-router) read these when a worker registers: the model id from
# served_model_name (else model_path), the tokenizer from tokenizer_path, dp_size for
# DP-aware routing, and the limits. Each replica is one engine, so its dp_size is 1.
@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> Response:
    info = server_state(request).info
    engine = info.engine
    return JSONResponse(
        {
            "model_path": info.model_path,
            "served_model_name": info.served_model_name,
            "tokenizer_path": info.tokenizer_path,
            "is_generation": True,
            "model_type": engine.get("model_type"),
            "architectures": [engine["architecture"]] if "architecture" in engine else None,
            "context_length": info.context_length,
            "max_model_len": info.context_length,
            **{k: v for k, v in engine.items() if k in ("page_size", "num_pages", "device")},
        }
    )


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> Response:
    info = server_state(request).info
    engine = info.engine
    pages = engine.get("num_pages")
    return JSONResponse(
        {
            "model_path": info.model_path,
            "served_model_name": info.served_model_name,
            "tokenizer_path": info.tokenizer_path,
            "dp_size": 1,
            "tp_size": info.tp_size,
            "context_length": info.context_length,
            "max_total_tokens": int(str(pages)) * int(str(engine["page_size"])) if pages else None,
            "max_running_requests": engine.get("max_running_requests"),
            "max_prefill_tokens": engine.get("chunked_prefill_size"),
            "version": minisgl.__version__,
        }
    )
