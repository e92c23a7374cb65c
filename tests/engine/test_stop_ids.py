"""The ids that end a request come from every place a checkpoint states them: ``config.json`` and
``generation_config.json`` (an int or a list) and the tokenizer's ``eos_token``."""

import json
import os

import pytest

from ouro_jax import LLM, SamplingParams
from weights import save_random
from weights.generation_config import read_eos_token_ids, read_tokenizer_eos_text

SMALL = dict(max_num_seqs=2, max_model_len=32, buckets=[8, 16], max_num_batched_tokens=16, progress=False)
PROMPT = [5, 9, 17, 33]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_random(tmp_path_factory.mktemp("ck") / "tiny", "tiny", seed=0, layout="hf", dtype="float32"))


def _write(folder, name, d):
    with open(os.path.join(folder, name), "w") as f:
        json.dump(d, f)


@pytest.mark.slow
def test_a_second_eos_in_generation_config_stops_greedy_output(folder):
    with LLM(folder, **SMALL) as llm:
        eos = llm.model_config.eos_token_id
        # config.json's <|endoftext|> and the preset tokenizer's eos_token <|im_end|>
        base = llm.scheduler_config.eos_token_ids
        assert base == (eos, llm.tokenizer.token_to_id("<|im_end|>"))
        free = llm.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0].token_ids
    assert not set(base) & set(free[:3]), free  # the weights' greedy output (seed 0) reaches past them
    k = next(i for i, t in enumerate(free) if i > 0 and t not in free[:i])
    _write(folder, "generation_config.json", {"eos_token_id": [eos, free[k]]})
    try:
        with LLM(folder, **SMALL) as llm:
            assert llm.scheduler_config.eos_token_ids == tuple(sorted({*base, free[k]}))
            [out] = llm.generate([PROMPT], SamplingParams(max_tokens=10), use_tqdm=False)
            assert out.token_ids == free[: k + 1] and out.finish_reason == "stop"
            # ignore_eos still runs past every one of them
            [out] = llm.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
            assert out.token_ids == free
    finally:
        os.remove(os.path.join(folder, "generation_config.json"))


def test_eos_ids_from_every_file(tmp_path):
    _write(tmp_path, "config.json", {"eos_token_id": [2, 0]})
    _write(tmp_path, "generation_config.json", {"eos_token_id": 7})
    _write(tmp_path, "tokenizer_config.json", {"eos_token": {"content": "<|im_end|>", "special": True}})
    assert read_eos_token_ids(str(tmp_path), vocab_size=128) == (0, 2, 7)
    assert read_tokenizer_eos_text(str(tmp_path)) == "<|im_end|>"
    _write(tmp_path, "generation_config.json", {"eos_token_id": 500})
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id 500 is outside the vocabulary"):
        read_eos_token_ids(str(tmp_path), vocab_size=128)
    _write(tmp_path, "generation_config.json", {"eos_token_id": [True]})
    with pytest.raises(ValueError, match="must be a non-negative integer or a list"):
        read_eos_token_ids(str(tmp_path), vocab_size=128)
    _write(tmp_path, "generation_config.json", [1])
    with pytest.raises(ValueError, match="must hold a JSON object"):
        read_eos_token_ids(str(tmp_path), vocab_size=128)


def test_a_bad_generation_config_fails_before_the_weights_are_read(folder, monkeypatch):
    import weights

    _write(folder, "generation_config.json", {"eos_token_id": 4096})
    monkeypatch.setattr(weights, "load_checkpoint", lambda *a, **k: pytest.fail("weights read"))
    try:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            LLM(folder, **SMALL)
    finally:
        os.remove(os.path.join(folder, "generation_config.json"))
