"""Stop strings end a sequence where decoding its whole output after every token would: the
output processor looks at the text of its last few tokens and decodes the whole output only
when a stop string may have been completed (`OutputProcessor._may_end_a_stop`)."""

from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from jaxengine.engine.output_processor import OutputProcessor
from jaxengine.engine.sampling_params import SamplingParams
from jaxengine.engine.sequence import Sequence
from jaxengine.run_config import DEFAULT_MODEL
from tests.property_examples import examples

TEXT = "Il était une fois, naïve café — 東京 «smörgåsbord» x = f(y) + 42; return [a, b]\n" * 20


def _sentencepiece_like() -> PreTrainedTokenizerFast:
    """A BPE tokenizer of the other common kind: spaces as ▁ and unknown characters as bytes."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tokenizer.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *bytes_]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def _wordpiece() -> PreTrainedTokenizerFast:
    """A WordPiece tokenizer (BERT's kind): "##" continuations, spaces cleaned up around punctuation."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tokenizer.train_from_iterator([TEXT], trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


TOKENIZERS = [AutoTokenizer.from_pretrained(DEFAULT_MODEL), _sentencepiece_like(), _wordpiece()]


def _where_the_whole_text_stops(tokenizer, outputs: list[int], params: SamplingParams):
    """(output tokens, stop string, text cut) where decoding the whole output after every
    token from `min_tokens` on first shows a stop string; None if it never does."""
    for k in range(max(params.min_tokens, 1), len(outputs) + 1):
        text = tokenizer.decode(outputs[:k], skip_special_tokens=params.skip_special_tokens)
        found = [(text.find(s), s) for s in params.stop if s in text]
        if found:
            at, stop = min(found)
            return k, stop, at + len(stop) if params.include_stop_str_in_output else at
    return None


@st.composite
def _cases(draw):
    which = draw(st.integers(0, len(TOKENIZERS) - 1))
    tokenizer = TOKENIZERS[which]
    if draw(st.booleans()):  # a real text's tokens, cut anywhere
        ids = tokenizer.encode(TEXT, add_special_tokens=False)
        start = draw(st.integers(0, len(ids) - 40))
        outputs = ids[start : start + draw(st.integers(1, 40))]
    else:  # any tokens: bytes cut mid-character, special tokens
        outputs = draw(st.lists(st.integers(0, len(tokenizer) - 1), min_size=1, max_size=40))
    text = tokenizer.decode(outputs, skip_special_tokens=True)
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        if text and draw(st.booleans()):  # a piece of the text the output decodes to
            at = draw(st.integers(0, len(text) - 1))
            stops.append(text[at : at + draw(st.integers(1, 6))])
        else:
            stops.append(draw(st.text("ab ;=\n.éé東", min_size=1, max_size=4)))
    params = SamplingParams(
        stop=stops,
        min_tokens=draw(st.integers(0, len(outputs))),
        max_tokens=len(outputs) + 5,
        ignore_eos=True,
        include_stop_str_in_output=draw(st.booleans()),
    )
    return which, outputs, params


@settings(max_examples=examples(300), deadline=None)
@given(_cases())
# A stop string early in the output, and min_tokens far past it: the first check looks at all.
@example(
    (
        0,
        TOKENIZERS[0].encode(TEXT, add_special_tokens=False)[:30],
        SamplingParams(stop="Il", min_tokens=25, max_tokens=40),
    )
)
def test_stop_strings_end_a_sequence_where_the_whole_text_would(case):
    which, outputs, params = case
    tokenizer = TOKENIZERS[which]
    processor = OutputProcessor(tokenizer, eos_token_ids=())
    prompt = [5, 6, 7]
    seq = Sequence("r", 0, list(prompt), len(prompt), params, seed=0)
    for token in outputs:
        processor.append(seq, token, None)
        if seq.finish_reason is not None:
            break
    got = None
    if seq.finish_reason == "stop":
        got = seq.num_output_tokens, seq.stop_reason, seq.stop_text_cut
    assert got == _where_the_whole_text_stops(tokenizer, outputs, params)
