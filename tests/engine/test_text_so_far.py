"""An unfinished output's text, decoded a window at a time (`TextSoFar`), is the text of
decoding its whole output, through outputs that grow a few tokens a step or many at once."""

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine.engine.text_so_far import WHOLE_UP_TO, WINDOW, TextSoFar
from tests.engine.test_stop_strings import TEXT, TOKENIZERS
from tests.property_examples import examples


@st.composite
def _outputs(draw):
    """A tokenizer's index, an output's tokens, and how many it grows by at each look."""
    which = draw(st.integers(0, len(TOKENIZERS) - 1))
    tokenizer = TOKENIZERS[which]
    if draw(st.booleans()):  # a real text's tokens, from anywhere
        ids = tokenizer.encode(TEXT * 3, add_special_tokens=False)
        start = draw(st.integers(0, len(ids) - WHOLE_UP_TO - 200))
        tokens = ids[start : start + draw(st.integers(1, WHOLE_UP_TO + 200))]
    else:  # any tokens: bytes cut mid-character, special tokens
        tokens = draw(st.lists(st.integers(0, len(tokenizer) - 1), min_size=1, max_size=WHOLE_UP_TO + 120))
    # Looks a few tokens apart (a step's), and some more than a window apart; past the
    # outputs decoded whole, most of them.
    first = draw(st.integers(1, WHOLE_UP_TO + 8))
    steps = [first] + draw(st.lists(st.one_of(st.integers(1, 4), st.integers(WINDOW, WINDOW + 8)), max_size=80))
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
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[: 3 * WHOLE_UP_TO]
    text = TextSoFar(tokenizer.decode)
    assert text.of(ids[: 2 * WHOLE_UP_TO]) == tokenizer.decode(ids[: 2 * WHOLE_UP_TO])
    cut = ids[: 2 * WHOLE_UP_TO - 3]  # cut (a preempted output, say)
    assert text.of(cut) == tokenizer.decode(cut)
    other = ids[WHOLE_UP_TO + 3 :]  # another list of the same length
    assert text.of(other) == tokenizer.decode(other)
