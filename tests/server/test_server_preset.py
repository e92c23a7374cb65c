"""A random preset chats out of the box: ``LLM("tiny")`` and ``ouro-jax serve tiny`` use the preset
tokenizer and chat template (``weights/tokenizer.py``); tools are accepted, rendered into the prompt
and refused when invalid. One in-process server of the ``tiny`` preset (no checkpoint folder). The
random model's output cannot be steered, so the reasoning and tool-call parsers are tested on known
text in ``test_parsers.py``; here only how the server takes tools and answers."""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from scheduler import SamplingParams  # noqa: E402
from tests.server.conftest import ENGINE  # noqa: E402

MODEL = "tiny"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def server():
    from ouro_jax.server.run import BackgroundServer, make_state
    from ouro_jax.server.startup import build_engine

    llm, _ = build_engine(MODEL, ENGINE)
    # a text prompt through LLM, before the server's engine thread owns the engine
    out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 5 and isinstance(out.text, str)
    assert out.text == llm.tokenizer.decode(out.token_ids)
    state = make_state(llm, MODEL, MODEL, max_queue=16)
    srv = BackgroundServer(state).start()
    srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=60, max_retries=0)
    yield srv
    srv.stop(timeout=30)


def _post(srv, **body):
    return httpx.post(srv.url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=60)


def test_preset_chats(server):
    r = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi!"}], max_tokens=5, temperature=0
    )
    ch = r.choices[0]
    assert isinstance(ch.message.content, str) and ch.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 5
    ids = ch.model_extra["token_ids"]
    assert ch.message.content == server.state.llm.tokenizer.decode(ids)
    # the turn ends at <|im_end|>: the chat request stops there
    assert server.state.turn_end_id() == server.state.llm.tokenizer.token_to_id("<|im_end|>")
    # a text completion decodes too
    r = server.client.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0)
    assert isinstance(r.choices[0].text, str)
