"""IncrementalDetokenizer against the tokenizer's own full decode."""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.sampling_params import SamplingParams

SAMPLES = [
    "Hello, world!",
    " leading space and  double  spaces",
    "naïve café, ça va? Ünïcödé",
    "日本語のテキスト 中文文本 世界",
    "emoji 🙂🎉👩‍👩‍👧 mixed with text",
    "tabs\tand\nnewlines\n\n  indented",
    "a . b , c 's n't",
]
ALPHABET = "ab xyzé世界🙂\n.,'"


@pytest.fixture(scope="session")
def bpe_tokenizer(smollm2_path):
    from kvserve.model_executor.gguf_tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def sp_tokenizer(tmp_path_factory):
    """A tiny Llama-style SentencePiece tokenizer: "▁" spaces, byte fallback."""
    import sentencepiece as spm
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    directory: Path = tmp_path_factory.mktemp("spm")
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(SAMPLES * 10) + "\nThe quick brown fox jumps over the lazy dog.\n")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(directory / "m"), vocab_size=400, hard_vocab_limit=False,
        model_type="unigram", byte_fallback=True, character_coverage=0.98,
        minloglevel=2,
    )
    processor = spm.SentencePieceProcessor(model_file=str(directory / "m.model"))
    pieces = [(processor.id_to_piece(i), processor.get_score(i))
              for i in range(processor.get_piece_size())]
    backend = Tokenizer(models.Unigram(pieces, unk_id=processor.unk_id(), byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def stream(tokenizer, prompt_ids: list[int], output_ids: list[int],
           params: SamplingParams) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed tokens one at a time like the engine; check streaming invariants."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    holdback = max((len(s) for s in params.stop), default=1) - 1
    deltas: list[str] = []
    stop = None
    for token_id in output_ids:
        stop = detok.add_tokens([token_id])
        if stop is not None:
            break
        deltas.append(detok.take_delta(finished=False))
        sent = "".join(deltas)
        assert len(sent) <= max(0, len(detok.output_text) - holdback)
    deltas.append(detok.take_delta(finished=True))
    sent = "".join(deltas)
    assert sent == detok.output_text
    # Every intermediate emission was a prefix of the final text: nothing retracted.
    for i in range(len(deltas)):
        assert detok.output_text.startswith("".join(deltas[:i]))
    return detok, deltas, stop


def continuation(tokenizer, prompt_ids: list[int], output_ids: list[int]) -> str:
    """Text the output adds after the prompt (what users see as the completion)."""
    prompt_text = tokenizer.decode(prompt_ids)
    full_text = tokenizer.decode(prompt_ids + output_ids)
    assert full_text.startswith(prompt_text)
    return full_text[len(prompt_text):]


@pytest.mark.parametrize("text", SAMPLES)
@pytest.mark.parametrize("with_prompt", [False, True])
def test_bpe_round_trip(bpe_tokenizer, text: str, with_prompt: bool) -> None:
    prompt = bpe_tokenizer.encode("Say it: 世", add_special_tokens=False) if with_prompt else []
    ids = bpe_tokenizer.encode(text, add_special_tokens=False)
    detok, deltas, _ = stream(bpe_tokenizer, prompt, ids, SamplingParams())
    assert detok.output_text == bpe_tokenizer.decode(ids) == text
    assert "\ufffd" not in "".join(deltas)


@pytest.mark.parametrize("text", SAMPLES)
def test_sentencepiece_round_trip(sp_tokenizer, text: str) -> None:
    ids = sp_tokenizer.encode(text, add_special_tokens=False)
    if "🙂" in text:  # emoji are too rare for the vocab: they must go through byte fallback
        assert any(t.startswith("<0x") for t in sp_tokenizer.convert_ids_to_tokens(ids))
    # No prompt: exactly the tokenizer's decode of the output ids.
    detok, deltas, _ = stream(sp_tokenizer, [], ids, SamplingParams())
    assert detok.output_text == sp_tokenizer.decode(ids)
    assert "\ufffd" not in "".join(deltas)
    # After a prompt the first token's "▁" is a real space, as in decode(prompt + output).
    prompt = sp_tokenizer.encode("The quick brown", add_special_tokens=False)
    detok, _, _ = stream(sp_tokenizer, prompt, ids, SamplingParams())
    assert detok.output_text == continuation(sp_tokenizer, prompt, ids)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(bpe_tokenizer, skip: bool) -> None:
    im_end = bpe_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = (bpe_tokenizer.encode("Hi 🙂", add_special_tokens=False) + [im_end]
           + bpe_tokenizer.encode(" there", add_special_tokens=False) + [im_end])
    prompt = bpe_tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    detok, _, _ = stream(bpe_tokenizer, prompt, ids, SamplingParams(skip_special_tokens=skip))
    assert detok.output_text == bpe_tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.output_text) is not skip


@pytest.mark.parametrize(("text", "stops", "hit"), [
    ("The answer is 42.\nUser: hi", ["\nUser:"], "\nUser:"),
    ("hello 世界 again and again", ["界 ag"], "界 ag"),
    ("one two three four", ["four", "two th"], "two th"),  # earliest match wins
    ("emoji 🙂🎉 end", ["🎉"], "🎉"),
    ("no stop here", ["zzz"], None),
])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(bpe_tokenizer, text: str, stops: list[str], hit: str | None,
                      include: bool) -> None:
    ids = bpe_tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    detok, deltas, stop = stream(bpe_tokenizer, [], ids, params)
    assert stop == hit
    if hit is None:
        assert detok.output_text == text
        return
    end = text.index(hit) + (len(hit) if include else 0)
    assert detok.output_text == text[:end]
    if not include:
        assert all(hit not in "".join(deltas[:i]) for i in range(len(deltas) + 1))


def test_stop_string_ignored_before_min_tokens(bpe_tokenizer) -> None:
    ids = bpe_tokenizer.encode("stop now, then stop again", add_special_tokens=False)
    params = SamplingParams(stop=["stop"], min_tokens=3)
    detok, _, stop = stream(bpe_tokenizer, [], ids, params)
    assert stop == "stop"
    assert detok.output_text == "stop now, then "


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=ALPHABET, max_size=30), prompt=st.text(alphabet=ALPHABET, max_size=8))
def test_property_valid_text(bpe_tokenizer, sp_tokenizer, text: str, prompt: str) -> None:
    bpe_ids = bpe_tokenizer.encode(text, add_special_tokens=False)
    bpe_prompt = bpe_tokenizer.encode(prompt, add_special_tokens=False)
    detok, _, _ = stream(bpe_tokenizer, bpe_prompt, bpe_ids, SamplingParams())
    assert detok.output_text == bpe_tokenizer.decode(bpe_ids) == text

    sp_ids = sp_tokenizer.encode(text, add_special_tokens=False)
    detok, _, _ = stream(sp_tokenizer, [], sp_ids, SamplingParams())
    assert detok.output_text == sp_tokenizer.decode(sp_ids)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_arbitrary_ids_bpe(bpe_tokenizer, data) -> None:
    """Any id sequence, including byte tokens that never form valid UTF-8."""
    byte_tokens = list(range(200, 260))  # single-byte tokens, many of them UTF-8 fragments
    id_strategy = st.one_of(st.sampled_from(byte_tokens), st.integers(0, len(bpe_tokenizer) - 1))
    ids = data.draw(st.lists(id_strategy, max_size=25))
    skip = data.draw(st.booleans())
    stops = data.draw(st.lists(st.text(alphabet="abe 世", min_size=1, max_size=3), max_size=2))
    params = SamplingParams(skip_special_tokens=skip, stop=stops)
    detok, _, stop = stream(bpe_tokenizer, [], ids, params)
    full = bpe_tokenizer.decode(ids, skip_special_tokens=skip)
    if stop is None:
        assert detok.output_text == full
    else:
        assert detok.output_text == full[: full.index(stop)]


def test_decode_window_stays_small(bpe_tokenizer) -> None:
    """Each step decodes a few recent tokens, not the whole sequence."""
    window_sizes: list[int] = []

    class Recording:
        def decode(self, ids, **kwargs):
            window_sizes.append(len(ids))
            return bpe_tokenizer.decode(ids, **kwargs)

    ids = bpe_tokenizer.encode("word 世界 🙂 " * 60, add_special_tokens=False)
    prompt = bpe_tokenizer.encode("a long prompt " * 20, add_special_tokens=False)
    detok, _, _ = stream(Recording(), prompt, ids, SamplingParams())
    assert len(ids) > 200 and detok.output_text == bpe_tokenizer.decode(ids)
    assert max(window_sizes) <= 12


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_backend_decoder_equals_the_tokenizers_decode(bpe_tokenizer, sp_tokenizer, skip_special_tokens):
    """The fast path (the Rust backend, without transformers' wrapper) gives the wrapper's
    text, special tokens included; a class with its own decode keeps that decode."""
    import random

    from kvserve.engine.detokenizer import decoder

    rng = random.Random(0)
    for tokenizer in (bpe_tokenizer, sp_tokenizer):
        fast = decoder(tokenizer, skip_special_tokens)
        assert fast.__closure__ is not None and any(
            cell.cell_contents is tokenizer.backend_tokenizer for cell in fast.__closure__)
        special = list(tokenizer.all_special_ids)
        for _ in range(200):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 12))]
            ids += rng.sample(special, k=min(2, len(special)))
            rng.shuffle(ids)
            assert fast(ids) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                                 clean_up_tokenization_spaces=False)

    class Shouting(type(sp_tokenizer)):
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs).upper()

    shouting = Shouting(tokenizer_object=sp_tokenizer.backend_tokenizer, bos_token="<s>", eos_token="</s>",
                        unk_token="<unk>", clean_up_tokenization_spaces=False)
    ids = sp_tokenizer.encode("The quick brown fox", add_special_tokens=False)
    text = decoder(shouting, skip_special_tokens)(ids)
    assert text == "THE QUICK BROWN FOX"
