"""logprobs, ``n`` and ``best_of`` through ``ouro-jax serve`` with the openai client, on a tiny
HF-layout checkpoint with the preset's character tokenizer: logprobs equal the float64 reference's
log-softmax, the choices of a prompt share its computation and keep their seeds, and bad requests
get OpenAI's 400 and leave every KV block free."""

from __future__ import annotations

import glob

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from tests.server.conftest import ENGINE  # noqa: E402

PROMPT = "Hello, loops!"
TOL = 2e-3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from ouro_jax.server.run import BackgroundServer, make_state
    from ouro_jax.server.startup import build_engine
    from weights import save_random

    folder = save_random(tmp_path_factory.mktemp("ck") / "tiny", "tiny", seed=3, layout="hf", dtype="float32")
    llm, _ = build_engine(folder, dict(ENGINE, max_model_len=128, max_n=4))
    srv = BackgroundServer(make_state(llm, "tiny", folder, max_queue=16, max_n=4)).start()
    srv.folder = folder
    srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=60, max_retries=0)
    yield srv
    srv.stop(timeout=30)


def _reference_first_logprobs(folder, ids) -> np.ndarray:
    from safetensors.numpy import load_file

    from ouro_jax import get_preset
    from ouro_jax.reference import load_reference_weights, reference_forward

    cfg = get_preset("tiny")
    tensors = {}
    for f in glob.glob(f"{folder}/*.safetensors"):
        tensors.update(load_file(f))
    ref = load_reference_weights(cfg, tensors)
    x = reference_forward(ref, cfg, ids)["hidden_states"][cfg.num_loops - 1, -1] @ ref.lm_head.T
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def _free(server) -> bool:
    return server.state.llm.scheduler.block_manager.num_used_blocks == 0


def test_completion_logprobs_equal_the_reference(server):
    llm = server.state.llm
    r = server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    ch = r.choices[0]
    ids = ch.model_extra["token_ids"]
    lp = ch.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) == r.usage.completion_tokens
    want = _reference_first_logprobs(server.folder, llm.encode(PROMPT).tolist())
    assert lp.token_logprobs[0] == pytest.approx(want[ids[0]], abs=TOL)
    top3 = np.argsort(-want)[:3]
    text = {int(t): llm.tokenizer.decode([int(t)], skip_special_tokens=False) for t in top3}
    for t in top3:  # the chosen token is among them (greedy: the first)
        assert lp.top_logprobs[0][text[t]] == pytest.approx(want[t], abs=TOL)
    assert "".join(lp.tokens) == ch.text and lp.text_offset[0] == 0


def test_chat_logprobs_and_top_logprobs(server):
    r = server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].token == e.token and e.logprob == pytest.approx(e.top_logprobs[0].logprob)
        assert bytes(e.bytes).decode() == e.token
    # without logprobs: none
    r = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert r.choices[0].logprobs is None


def test_n_choices_share_the_prompt_and_keep_their_seeds(server):
    llm = server.state.llm
    before = llm.stats()["shared_prompt_tokens"]
    r = server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    n_prompt = len(llm.encode(PROMPT))
    assert r.usage.prompt_tokens == n_prompt  # the prompt counts once
    assert r.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in r.choices)
    assert llm.stats()["shared_prompt_tokens"] - before == 2 * ((n_prompt - 1) // ENGINE["block_size"] * 4)
    # choice j is the request seeded 5 + j
    for j, c in enumerate(r.choices):
        alone = server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5 + j)
        assert c.text == alone.choices[0].text
    assert len({c.text for c in r.choices}) > 1
    greedy = server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, n=2
    )
    a, b = greedy.choices
    assert a.message.content == b.message.content and (a.index, b.index) == (0, 1)
    assert _free(server)


def test_best_of_returns_the_likeliest(server):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=5, temperature=1.0, seed=9)
    every = server.client.completions.create(**kw, n=3, logprobs=0)
    best = server.client.completions.create(**kw, best_of=3, logprobs=0)
    sums = [sum(c.logprobs.token_logprobs) for c in every.choices]
    [ch] = best.choices
    assert ch.text == every.choices[int(np.argmax(sums))].text
    assert sum(ch.logprobs.token_logprobs) == pytest.approx(max(sums), abs=1e-4)
    # every choice made counts in usage; without logprobs asked, none are shown
    plain = server.client.completions.create(**kw, best_of=3, n=2)
    assert len(plain.choices) == 2 and plain.choices[0].logprobs is None
    assert plain.usage.completion_tokens == 15


def test_streamed_choices_carry_their_logprobs(server):
    stream = server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0.7, seed=1,
        n=2, logprobs=True, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    got, usage = {0: [], 1: []}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            ids = c.model_extra.get("token_ids") or []
            entries = c.logprobs.content if c.logprobs is not None else []
            assert len(entries) == len(ids)
            got[c.index] += ids
    assert usage is not None and usage.completion_tokens == len(got[0]) + len(got[1]) == 8


@pytest.mark.parametrize(
    "endpoint, body, param",
    [
        ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("chat/completions", {"logprobs": 3}, "logprobs"),
        ("chat/completions", {"n": 0}, "n"),
        ("chat/completions", {"n": 5}, "n"),  # over the server's max_n
        ("chat/completions", {"best_of": 2}, "best_of"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("completions", {"best_of": 1, "n": 2}, "best_of"),
        ("completions", {"best_of": 3, "stream": True}, "best_of"),
        ("completions", {"best_of": 5}, "best_of"),
        ("completions", {"top_logprobs": 3}, "top_logprobs"),
    ],
)
def test_bad_choice_requests_are_400(server, endpoint, body, param):
    base = {"messages": [{"role": "user", "content": "Hi"}]} if endpoint == "chat/completions" else {"prompt": "Hi"}
    r = httpx.post(f"{server.url}/v1/{endpoint}", json={"model": "tiny", "max_tokens": 2, **base, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    # the server answers as before, every block free
    ok = server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
    assert len(ok.choices) == 1 and _free(server)


def test_sampling_fields_change_the_output(server):
    """logit_bias, the penalties, min_p and min_tokens reach the device sampler (the same request
    without them gives other tokens)."""
    llm = server.state.llm
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    ids = lambda **extra: server.client.completions.create(  # noqa: E731
        **kw, extra_body={"ignore_eos": True, **extra}
    ).choices[0]
    plain = ids().model_extra["token_ids"]
    x = llm.tokenizer.token_to_id("x")
    assert ids(logit_bias={str(x): 100}).text == "x" * 8
    for extra in (dict(presence_penalty=2.0), dict(frequency_penalty=2.0), dict(repetition_penalty=2.0)):
        got = ids(**extra).model_extra["token_ids"]
        assert got != plain and len(set(got)) >= len(set(plain)), extra
    eos = llm.scheduler_config.eos_token_ids[0]
    body = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logit_bias={str(eos): 100})
    assert server.client.completions.create(**body).choices[0].model_extra["token_ids"] == [eos]
    late = server.client.completions.create(**body, extra_body={"min_tokens": 2}).choices[0]
    assert late.model_extra["token_ids"][2:] == [eos] and late.finish_reason == "stop"
    assert _free(server)


def test_prompt_logprobs_as_vllm_spells_them(server):
    llm = server.state.llm
    ids = llm.encode(PROMPT).tolist()
    r = server.client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2}, temperature=0
    )
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    want = _reference_first_logprobs(server.folder, ids[:1])  # the state of position 0 predicts token 1
    entry = plp[1][str(ids[1])]
    assert entry["logprob"] == pytest.approx(want[ids[1]], abs=TOL)
    assert entry["decoded_token"] == llm.tokenizer.decode([ids[1]], skip_special_tokens=False)
    assert all(len(p) in (2, 3) for p in plp[1:])  # the prompt token and its 2 alternatives (it may be one)
    bad = httpx.post(
        f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "prompt_logprobs": 21}, timeout=30
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.slow
def test_generation_config_eos_stops_before_it(tmp_path):
    """A second eos_token_id in generation_config.json ends greedy output at that token with
    finish_reason "stop", its text left out; ignore_eos runs past it."""
    import json

    from ouro_jax.server.run import BackgroundServer, make_state
    from ouro_jax.server.startup import build_engine
    from weights import save_random

    folder = save_random(tmp_path / "tiny", "tiny", seed=3, layout="hf", dtype="float32")
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)

    def serve():
        llm, _ = build_engine(folder, dict(ENGINE, max_model_len=128))
        srv = BackgroundServer(make_state(llm, "tiny", folder, max_queue=4)).start()
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=60, max_retries=0)
        return srv

    srv = serve()
    try:
        free = srv.client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0]
        eos = set(srv.state.llm.scheduler_config.eos_token_ids)
        tok = srv.state.llm.tokenizer
    finally:
        srv.stop(timeout=30)
    ids = free.model_extra["token_ids"]
    assert not eos & set(ids[:3]), ids
    k = next(i for i, t in enumerate(ids) if i > 0 and t not in ids[:i])
    with open(f"{folder}/generation_config.json", "w") as f:
        json.dump({"eos_token_id": [*sorted(eos), ids[k]]}, f)
    srv = serve()
    try:
        ch = srv.client.completions.create(**kw).choices[0]
        assert ch.model_extra["token_ids"] == ids[: k + 1] and ch.finish_reason == "stop"
        assert ch.text == tok.decode(ids[:k])  # the stop token's text is left out
        again = srv.client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0]
        assert again.model_extra["token_ids"] == ids
    finally:
        srv.stop(timeout=30)
