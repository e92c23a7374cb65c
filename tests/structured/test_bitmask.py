"""apply_token_bitmask (jnp) against its numpy twin on awkward shapes."""

import jax
import numpy as np
import pytest

from ouro_jax.structured import apply_token_bitmask, apply_token_bitmask_reference, bitmask_words, new_bitmask


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 300])
def test_matches_reference_on_random_masks(vocab):
    rng = np.random.default_rng(vocab)
    rows = 5
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    i32 = np.iinfo(np.int32)
    bitmask = rng.integers(i32.min, i32.max, size=(rows, bitmask_words(vocab)), dtype=np.int32)
    bitmask[1] = -1  # all allowed
    bitmask[2] = 0
    bitmask[2, (vocab - 1) // 32] = np.int32(np.uint32(1 << ((vocab - 1) % 32)).view(np.int32))  # only the last id
    got = np.asarray(jax.jit(apply_token_bitmask)(logits, bitmask))
    want = apply_token_bitmask_reference(logits, bitmask)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[1], logits[1])
    assert np.isfinite(got[2]).sum() == 1 and np.argmax(got[2]) == vocab - 1
    for r in range(rows):  # bit t of word t // 32 says token t
        bits = [(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
        np.testing.assert_array_equal(np.isfinite(want[r]), np.array(bits, dtype=bool))


def test_bits_past_the_vocabulary_are_ignored_and_dtype_kept():
    bitmask = new_bitmask(2, 40)  # -1: the 24 bits past id 39 are set too
    got = apply_token_bitmask(jax.numpy.zeros((2, 40), jax.numpy.bfloat16), bitmask)
    assert got.dtype == jax.numpy.bfloat16 and got.shape == (2, 40)
    assert np.isfinite(np.asarray(got, np.float32)).all()


def test_wrong_word_count_is_refused():
    with pytest.raises(ValueError, match="words"):
        apply_token_bitmask_reference(np.zeros((1, 33), np.float32), np.zeros((1, 1), np.int32))
