"""Grammar matchers on a byte tokenizer: valid outputs walk through, invalid tokens are refused,
masked greedy decoding of random logits always yields output the constraint accepts."""

import json
import re

import numpy as np
import pytest

from ouro_jax.structured import GuidedDecoding, apply_token_bitmask_reference, new_bitmask

from .conftest import EOS_IDS, MODEL_VOCAB

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 120},
        "valid": {"type": "boolean"},
        "tag": {"type": "string", "maxLength": 6},
    },
    "required": ["color", "count", "valid", "tag"],
    "additionalProperties": False,
}
WHITESPACE = " \n\t\r"


def allowed(bitmask_row: np.ndarray) -> np.ndarray:
    return np.nonzero(((bitmask_row[:, None] >> np.arange(32)) & 1).reshape(-1)[:MODEL_VOCAB])[0]


def walk(matcher, tokenizer, text):
    """Accept ``text`` token by token, checking each token was in the mask; the masks seen."""
    masks = []
    for tid in tokenizer.encode(text).ids:
        mask = new_bitmask(1, MODEL_VOCAB)
        matcher.fill_bitmask(mask, 0)
        masks.append(mask[0])
        assert tid in allowed(mask[0]), (text, tokenizer.decode([tid]))
        assert matcher.accept(tid)
    return masks


def matches_schema(obj) -> bool:
    return (
        isinstance(obj, dict)
        and set(obj) == set(SCHEMA["required"])
        and obj["color"] in ("red", "green", "blue")
        and type(obj["count"]) is int
        and 1 <= obj["count"] <= 120
        and type(obj["valid"]) is bool
        and isinstance(obj["tag"], str)
        and len(obj["tag"]) <= 6
    )


def greedy_masked(matcher, tokenizer, rng, max_tokens=200) -> str:
    """Argmax of random logits under the grammar's mask until the matcher stops."""
    ids = []
    mask = new_bitmask(1, MODEL_VOCAB)
    while not matcher.is_terminated():
        assert len(ids) < max_tokens, tokenizer.decode(ids)
        matcher.fill_bitmask(mask, 0)
        logits = apply_token_bitmask_reference(rng.normal(size=(1, MODEL_VOCAB)).astype(np.float32), mask)
        tid = int(np.argmax(logits[0]))
        assert tid < 258, "a padding id was allowed"
        assert matcher.accept(tid)
        ids.append(tid)
    return tokenizer.decode([t for t in ids if t not in EOS_IDS])


def test_schema_walk_accepts_and_terminates(compiler, tokenizer):
    m = compiler.matcher(GuidedDecoding.json_schema(SCHEMA))
    text = json.dumps({"color": "green", "count": 42, "valid": True, "tag": "a b"}, separators=(",", ":"))
    masks = walk(m, tokenizer, text)
    assert m.eos_allowed() and m.is_terminated()
    assert all(not set(EOS_IDS) & set(allowed(mask)) for mask in masks), "EOS allowed before the object closed"
    mask = new_bitmask(1, MODEL_VOCAB)
    m.fill_bitmask(mask, 0)
    assert set(allowed(mask[0])) <= set(EOS_IDS)


def test_invalid_tokens_are_refused(compiler, tokenizer):
    m = compiler.matcher(GuidedDecoding.json_schema(SCHEMA))
    enc = tokenizer.token_to_id
    assert not m.accept(enc("x"))  # refused, state unchanged
    walk(m, tokenizer, '{"color":"')
    assert not m.accept(enc("y"))  # not an enum value's start
    walk(m, tokenizer, 'red","count":12')
    assert not m.accept(enc("1"))  # 121 > maximum
    walk(m, tokenizer, '0,"valid":')
    assert not m.accept(enc("1"))


def test_masked_greedy_decoding_validates_against_schema(compiler, tokenizer):
    guided = GuidedDecoding.json_schema(SCHEMA)
    for seed in range(8):
        text = greedy_masked(compiler.matcher(guided), tokenizer, np.random.default_rng(seed))
        assert matches_schema(json.loads(text)), text


def test_compact_json_allows_no_whitespace_between_tokens(compiler, tokenizer):
    text = '{"a":[1,2,{"b":true}],"c":null,"d":"x y"}'
    m = compiler.matcher(GuidedDecoding.json_object())
    ws = {tokenizer.encode(c).ids[0] for c in WHITESPACE}
    for i, mask in enumerate(walk(m, tokenizer, text)):
        in_string = text[:i].count('"') % 2 == 1
        assert in_string or not ws & set(allowed(mask)), text[:i]
    assert m.is_terminated()
    loose = compiler.matcher(GuidedDecoding.json_object(compact_json=False))
    walk(loose, tokenizer, '{ "a" : 1 }')


def test_json_object_decoding_yields_an_object(compiler, tokenizer):
    text = greedy_masked(compiler.matcher(GuidedDecoding.json_object()), tokenizer, np.random.default_rng(0), 400)
    assert isinstance(json.loads(text), dict), text


def test_choice(compiler, tokenizer):
    guided = GuidedDecoding.choice(["yes", "no", "maybe"])
    m = compiler.matcher(guided)
    mask = new_bitmask(1, MODEL_VOCAB)
    m.fill_bitmask(mask, 0)
    assert sorted(tokenizer.decode([t]) for t in allowed(mask[0])) == ["m", "n", "y"]
    walk(m, tokenizer, "no")
    assert m.is_terminated()
    for seed in range(4):
        assert greedy_masked(compiler.matcher(guided), tokenizer, np.random.default_rng(seed)) in ("yes", "no", "maybe")


def test_regex(compiler, tokenizer):
    guided = GuidedDecoding.regex(r"[0-9]{3}-[a-z]+")
    m = compiler.matcher(guided)
    walk(m, tokenizer, "123-a")
    assert m.eos_allowed() and not m.is_terminated()  # more letters may follow
    assert not m.accept(tokenizer.token_to_id("-"))
    assert m.accept(EOS_IDS[0]) and m.is_terminated()
    for seed in range(4):
        out = greedy_masked(compiler.matcher(guided), tokenizer, np.random.default_rng(seed))
        assert re.fullmatch(r"[0-9]{3}-[a-z]+", out), out


def test_grammar_lark_and_gbnf(compiler, tokenizer):
    for text in ('start: "ab" | "cd"', 'root ::= "ab" | "cd"'):
        m = compiler.matcher(GuidedDecoding.grammar(text))
        walk(m, tokenizer, "cd")
        assert m.is_terminated()


def test_rollback_restores_the_mask(compiler, tokenizer):
    m = compiler.matcher(GuidedDecoding.json_schema(SCHEMA))
    before = walk(m, tokenizer, '{"color":"')
    walk(m, tokenizer, "blu")
    m.rollback(3)
    after = new_bitmask(1, MODEL_VOCAB)
    m.fill_bitmask(after, 0)
    walk_again = compiler.matcher(GuidedDecoding.json_schema(SCHEMA))
    walk(walk_again, tokenizer, '{"color":"')
    expected = new_bitmask(1, MODEL_VOCAB)
    walk_again.fill_bitmask(expected, 0)
    assert before and np.array_equal(after, expected)


def test_schema_properties_come_in_schema_order(compiler, tokenizer):
    m = compiler.matcher(GuidedDecoding.json_schema(SCHEMA))
    walk(m, tokenizer, '{"color":"red","count":1,"')
    assert not m.accept(tokenizer.token_to_id("t"))  # "tag" is declared after "valid"


def test_equal_schemas_share_one_compiled_grammar(compiler):
    a = GuidedDecoding.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    b = GuidedDecoding.json_schema('{"type": "object",\n "properties": {"x": {"type": "integer"}}}')
    assert a == b and hash(a) == hash(b)
    m1, m2 = compiler.matcher(a), compiler.matcher(b)
    assert m1 is not m2 and sum(k == a for k in compiler._compiled) == 1


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda: GuidedDecoding.json_schema({"type": "integr"}), "integr"),
        (lambda: GuidedDecoding.json_schema('{"type": '), "not valid JSON"),
        (lambda: GuidedDecoding.json_schema({"type": "integer", "minimum": "x"}), "minimum"),
        (lambda: GuidedDecoding.regex("[a-"), "unclosed character class"),
        (lambda: GuidedDecoding.grammar("start: foo"), "foo"),
        (lambda: GuidedDecoding.choice([]), "non-empty"),
        (lambda: GuidedDecoding("xml", "<a/>"), "kind"),
    ],
)
def test_bad_spec_raises_value_error(make, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        make()
