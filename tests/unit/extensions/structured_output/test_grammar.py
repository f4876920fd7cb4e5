"""Structured output (scheduler/grammar.py) on the bundled default model, offline.

The outputs are checked against independent references: Python's ``re.fullmatch`` for
regexes, ``jsonschema`` for JSON schemas, and xgrammar's own mask kernel for our bitmask
unpacking. Constrained rows must not change unconstrained rows of the same batch, overlap
scheduling and preemption must not change constrained outputs, and a grammar that does not
compile is a ValueError naming its field that queues nothing.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.engine.logit_mask import apply_token_bitmask
from tests.helpers import assert_engine_clean
from tests.workloads import thinking_chat

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "likes": {"type": "array", "items": {"enum": ["tea", "coffee"]}, "maxItems": 2},
    },
    "required": ["name", "age", "likes"],
    "additionalProperties": False,
}
CODE = r"[A-Z]{2}-[0-9]{3}"
YES_NO = 'root ::= ("yes" | "no") ", because " [a-z]+ "."'


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM() as engine:
        yield engine


def _workload() -> tuple[list[str], list[SamplingParams]]:
    prompts = [
        "Describe a person as JSON:",
        "Give me a product code:",
        "Is the sky blue? Answer:",
        "Tell me a story about a cat.",
        "Describe a person as JSON:",
        "The capital of France is",
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=80, json_schema=json.dumps(PERSON)),
        SamplingParams(temperature=0, max_tokens=20, regex=CODE),
        SamplingParams(temperature=0, max_tokens=40, ebnf=YES_NO),
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0.9, seed=5, max_tokens=80, json_schema=json.dumps(PERSON)),
        SamplingParams(temperature=0, max_tokens=12),
    ]
    return prompts, params


def _check_constraint(out: dict[str, Any], params: SamplingParams) -> None:
    text = out["text"]
    assert out["finish_reason"] == "stop", out
    if params.json_schema is not None:
        jsonschema.validate(json.loads(text), json.loads(params.json_schema))
    elif params.regex is not None:
        assert re.fullmatch(params.regex, text), text
    elif params.ebnf is not None:
        assert re.fullmatch(r"(yes|no), because [a-z]+\.", text), text


def test_bitmask_unpacking_matches_xgrammar() -> None:
    g = torch.Generator().manual_seed(0)
    for vocab in (64, 1000, 49152):
        logits = torch.randn(3, vocab, generator=g)
        mask = xgr.allocate_token_bitmask(3, vocab)
        mask.copy_(torch.randint(-(2**31), 2**31 - 1, mask.shape, generator=g, dtype=torch.int32))
        mask[1] = -1  # an unconstrained row
        want = logits.clone()
        xgr.apply_token_bitmask_inplace(want, mask)
        assert torch.equal(apply_token_bitmask(logits, mask), want)


def test_outputs_follow_their_grammar(llm: LLM) -> None:
    prompts, params = _workload()
    outs = llm.generate(prompts, params)
    for out, p in zip(outs, params, strict=True):
        if p.grammar is not None:
            _check_constraint(out, p)
    assert_engine_clean(llm)


def test_constrained_rows_leave_the_others_alone(llm: LLM) -> None:
    prompts, params = _workload()
    together = llm.generate(prompts, params)
    for i, p in enumerate(params):
        if p.grammar is None:
            alone = llm.generate([prompts[i]], [p])[0]
            assert alone["token_ids"] == together[i]["token_ids"]


def test_overlap_scheduling_gives_the_same_tokens(llm: LLM) -> None:
    prompts, params = _workload()
    before = [o["token_ids"] for o in llm.generate(prompts, params)]
    llm.scheduler.overlap = True
    try:
        after = [o["token_ids"] for o in llm.generate(prompts, params)]
    finally:
        llm.scheduler.overlap = False
    assert after == before
    assert_engine_clean(llm)


def test_preemption_keeps_the_grammar_state(llm: LLM) -> None:
    """A small pool retracts running requests; each resumes with its matcher where it was, so
    the outputs equal those of a pool large enough for all."""
    prompts = ["Describe a person as JSON:"] * 3 + ["Give me a product code:"] * 3
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=80, json_schema=json.dumps(PERSON))
        for i in range(3)
    ] + [SamplingParams(temperature=0.8, seed=i, max_tokens=20, regex=CODE) for i in range(3)]
    want = [o["token_ids"] for o in llm.generate(prompts, params)]
    with LLM(num_pages=56, init_new_token_ratio=0.05, chunked_prefill_size=16) as small:
        outs = small.generate(prompts, params)
        assert small.scheduler.num_retractions > 0, "the small pool was meant to preempt"
        assert [o["token_ids"] for o in outs] == want
        for out, p in zip(outs, params, strict=True):
            _check_constraint(out, p)
        assert_engine_clean(small)


# Reasoning (grammar_after): worked turns (tests/workloads.py) make a greedy reply think on its
# own and then end its thinking.
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "big": {"type": "boolean"}},
    "required": ["city", "big"],
    "additionalProperties": False,
}
THINKING_CHAT = thinking_chat()
CITY_RE = r'\{"city": "[A-Z][a-z]+"\}'


def _after_thinking(llm: LLM, free: list[int], out: dict[str, Any]) -> str:
    """The constrained output's text after its thinking, which must be the free output's up
    to and including "</think>" (the grammar left the thinking alone)."""
    marker = llm.tokenizer.encode("</think>", add_special_tokens=False)
    n = len(marker)
    end = next(i + n for i in range(len(free)) if free[i : i + n] == marker)
    assert out["token_ids"][:end] == free[:end], (out["text"], llm.tokenizer.decode(free))
    assert out["finish_reason"] == "stop", out
    return str(llm.tokenizer.decode(out["token_ids"][end:], skip_special_tokens=True))


# Overlap every day in test_overlap_scheduling_gives_the_same_tokens; here it is a repeat.
@pytest.mark.parametrize("overlap", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_grammar_waits_for_the_end_of_the_thinking(llm: LLM, overlap: bool) -> None:
    """With grammar_after the thinking is free text (the same tokens as with no grammar at
    all) and what follows "</think>" matches the grammar; without it the grammar constrains
    from the first token, as before. Rows of both kinds and a free row share the batches."""
    prompt = llm.apply_chat_template(THINKING_CHAT)
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=48))[0]
    assert re.match(r"<think>[^<]+</think>", free["text"]), free  # the arrangement holds
    schema = json.dumps(CITY)
    params = [
        SamplingParams(temperature=0, max_tokens=64, json_schema=schema, grammar_after="</think>"),
        SamplingParams(temperature=0, max_tokens=48, regex=CITY_RE, grammar_after="</think>"),
        SamplingParams(temperature=0, max_tokens=64, json_schema=schema),
        SamplingParams(temperature=0, max_tokens=48),
    ]
    llm.scheduler.overlap = overlap
    try:
        outs = llm.generate([prompt] * len(params), params)
        twins = llm.generate(prompt, dataclasses.replace(params[0], n=2))
    finally:
        llm.scheduler.overlap = False
    jsonschema.validate(json.loads(_after_thinking(llm, free["token_ids"], outs[0])), CITY)
    assert re.fullmatch(CITY_RE, _after_thinking(llm, free["token_ids"], outs[1])), outs[1]
    assert not outs[2]["text"].startswith("<think>")  # no grammar_after: JSON from the start
    jsonschema.validate(json.loads(outs[2]["text"]), CITY)
    assert outs[3]["token_ids"] == free["token_ids"]
    assert [t["token_ids"] for t in twins] == [outs[0]["token_ids"]] * 2  # n=2: a matcher each
    assert_engine_clean(llm)


def test_a_prompt_that_closed_the_thinking_is_constrained_at_once(llm: LLM) -> None:
    """A prompt that already ends with "</think>" (then whitespace, as Qwen3's template with
    enable_thinking false writes it) gets the grammar from the first token: the output is
    what it is without grammar_after. A thinking block left open is waited for."""
    prompt = llm.apply_chat_template(THINKING_CHAT)
    closed = prompt + llm.tokenizer.encode(
        "<think>Paris is big</think>\n\n", add_special_tokens=False
    )
    opened = prompt + llm.tokenizer.encode("<think>", add_special_tokens=False)
    marker = tuple(llm.tokenizer.encode("</think>", add_special_tokens=False))
    assert llm.scheduler.constraints.wait_for("</think>", closed) == ()
    assert llm.scheduler.constraints.wait_for("</think>", opened) == marker
    schema = json.dumps(CITY)
    plain = SamplingParams(temperature=0, max_tokens=64, json_schema=schema)
    waits = dataclasses.replace(plain, grammar_after="</think>")
    outs = llm.generate([closed, closed, opened], [plain, waits, waits])
    assert outs[1]["token_ids"] == outs[0]["token_ids"]
    jsonschema.validate(json.loads(outs[1]["text"]), CITY)
    thought, _, content = outs[2]["text"].partition("</think>")
    assert thought and "{" not in thought, outs[2]  # free text, then the JSON
    jsonschema.validate(json.loads(content), CITY)
    assert_engine_clean(llm)


@pytest.mark.slow  # retraction (test_preemption_keeps_the_grammar_state) while waiting
def test_preemption_while_thinking(llm: LLM) -> None:
    """Requests retracted before, while or after their thinking resume where they were (still
    waiting for "</think>", or with their matcher's state): the outputs equal those of a pool
    large enough for all, and each is free thinking, then the grammar."""
    cities = ["Paris", "Berlin", "Madrid", "Vienna"]
    prompts = [llm.apply_chat_template(thinking_chat(c)) for c in cities]
    params = SamplingParams(temperature=0, max_tokens=40, regex=CITY_RE, grammar_after="</think>")
    want = [o["token_ids"] for o in llm.generate(prompts, params)]
    with LLM(num_pages=200, init_new_token_ratio=0.05, chunked_prefill_size=32) as small:
        outs = small.generate(prompts, params)
        assert small.scheduler.num_retractions > 0, "the small pool was meant to preempt"
        assert [o["token_ids"] for o in outs] == want
        for out in outs:
            thought, _, content = out["text"].partition("</think>")
            assert thought.startswith("<think>") and "{" not in thought, out
            assert re.fullmatch(CITY_RE, content) and out["finish_reason"] == "stop", out
        assert_engine_clean(small)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"regex": "([a-z"}, "regex"),
        ({"ebnf": "root ::= missing_rule"}, "ebnf"),
        ({"json_schema": '{"type": "no-such-type"}'}, "json_schema"),
    ],
)
def test_a_grammar_that_does_not_compile_queues_nothing(
    llm: LLM, fields: dict[str, str], field: str
) -> None:
    good = SamplingParams(temperature=0, max_tokens=4)
    bad = SamplingParams(temperature=0, max_tokens=4, **fields)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        llm.generate(["Hi", "Hello"], [good, bad])
    assert not llm.scheduler.waiting and not llm.scheduler.running
    assert llm.generate(["Hi"], good)[0]["finish_reason"] is not None
    assert_engine_clean(llm)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf must not be set together with regex"),
        ({"json_schema": "{not json"}, "json_schema must be a JSON document"),
        ({"json_schema": "[1, 2]"}, "json_schema must be a JSON object"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"regex": "a+", "min_tokens": 2, "max_tokens": 4}, "min_tokens must be 0"),
        ({"grammar_after": "</think>"}, "grammar_after requires json_schema, regex or ebnf"),
        ({"regex": "a", "grammar_after": ""}, "grammar_after must be None or a non-empty"),
    ],
)
def test_invalid_grammar_fields_are_value_errors(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)
