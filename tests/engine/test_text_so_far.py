"""An unfinished output's text, decoded a window at a time (`TextSoFar`), is the text of
decoding its whole output, through outputs that grow a few tokens a step or many at once."""

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine.engine.text_so_far import WINDOW, TextSoFar
from tests.engine.test_stop_strings import TEXT, TOKENIZERS
from tests.property_examples import examples


@st.composite
def _outputs(draw):
    """A tokenizer's index, an output's tokens, and how many it grows by at each look."""
    which = draw(st.integers(0, len(TOKENIZERS) - 1))
    tokenizer = TOKENIZERS[which]
    if draw(st.booleans()):  # a real text's tokens, from anywhere
        ids = tokenizer.encode(TEXT, add_special_tokens=False)
        start = draw(st.integers(0, len(ids) - 200))
        tokens = ids[start : start + draw(st.integers(1, 200))]
    else:  # any tokens: bytes cut mid-character, special tokens
        tokens = draw(st.lists(st.integers(0, len(tokenizer) - 1), min_size=1, max_size=120))
    steps = draw(st.lists(st.one_of(st.integers(1, 4), st.integers(WINDOW, WINDOW + 8)), min_size=1, max_size=60))
    return which, tokens, steps, draw(st.booleans())


@settings(max_examples=examples(300), deadline=None)
@given(_outputs())
def test_the_text_so_far_is_the_whole_outputs_text_at_every_look(case):
    which, tokens, steps, skip_special = case
    tokenizer = TOKENIZERS[which]

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=skip_special)

    text, seen = TextSoFar(decode), 0
    for step in steps:
        seen = min(seen + step, len(tokens))
        assert text.of(tokens[:seen]) == decode(tokens[:seen]), seen
    assert text.of(tokens) == decode(tokens)


def test_a_list_replaced_or_cut_is_decoded_whole():
    tokenizer = TOKENIZERS[0]
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:100]
    text = TextSoFar(tokenizer.decode)
    assert text.of(ids[:80]) == tokenizer.decode(ids[:80])
    assert text.of(ids[:50]) == tokenizer.decode(ids[:50])  # cut (a preempted output, say)
    other = ids[50:100]
    assert text.of(other) == tokenizer.decode(other)  # another list of the same length
