"""prompt_syntax.py and text/chunks.py: AUTOMATIC1111's prompt reading and its 75-token chunks, values asserted.

Parsing against the web UI's own doctest values and the rules of its parse_prompt_attention, each refusal's
field and wording; chunking with the presets' tokenizer (one token per "dog") and with a word-per-token fake
tokenizer where exact positions matter (embeddings across a chunk boundary and through the comma rule). A truncated
prompt's warning names token counts, never the prompt.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from diffgraph.request import ParamError
from diffgraph.text.chunks import EmbeddingMatcher, EmbeddingRef, TokenChunks, chunk_tokens, pad_to, with_pad
from diffgraph.prompt_syntax import BREAK, MAX_OPEN, SQUARE, ParsedPrompt, parse_a1111

# -- syntax --------------------------------------------------------------------------------------------

PARSED = [
    ("normal text", (("normal text", 1.0),)),
    ("an (important) word", (("an ", 1.0), ("important", 1.1), (" word", 1.0))),
    ("(unbalanced", (("unbalanced", 1.1),)),
    ("[unbalanced", (("unbalanced", 1 / 1.1),)),
    (r"\(literal\]", (("(literal]", 1.0),)),
    ("(unnecessary)(parens)", (("unnecessaryparens", 1.1),)),
    # the web UI's doctest, to the last bit (its multiplication order)
    ("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
     (("a ", 1.0), ("house", 1.5730000000000004), (" ", 1.1), ("on", 1.0), (" a ", 1.1), ("hill", 0.55),
      (", sun, ", 1.1), ("sky", 1.4641000000000006), (".", 1.1))),
    ("[dog]", (("dog", SQUARE),)),
    ("[[dog]]", (("dog", SQUARE * SQUARE),)),
    ("(dog:0)", (("dog", 0.0),)),
    ("(dog:-1) cat", (("dog", -1.0), (" cat", 1.0))),
    ("(dog: 1.5 )", (("dog", 1.5),)),
    ("((dog:2))", (("dog", 2.2),)),
    ("([dog])", (("dog", 1.1 * SQUARE),)),
    ("a) b] c", (("a) b] c", 1.0),)),          # closing brackets without an open one are text
    ("a:1.2) b", (("a:1.2) b", 1.0),)),         # so is a weight with no open round bracket
    ("[a:b]", (("a:b", SQUARE),)),               # a colon with no number after it: emphasis
    (r"a\b \\ c\ ", (("ab \\ c ", 1.0),)),   # \\ is one backslash; a lone one disappears (the web UI's code)
    (r"\[a:b:0.5\] \(x\)", (("[a:b:0.5] (x)", 1.0),)),
    # not editing by the web UI's grammar: an escaped colon, a stray ")" inside, three colons
    (r"[cat\:0.5]", (("cat:0.5", SQUARE),)),
    ("[a) b:0.5]", (("a) b:0.5", SQUARE),)),
    ("[a:b:c:0.5]", (("a:b:c:0.5", SQUARE),)),
    ("[x:[a:b]:0.5]", (("x:", SQUARE), ("a:b", SQUARE * SQUARE), (":0.5", SQUARE))),
    ("a BREAK b", (("a", 1.0), BREAK, ("b", 1.0))),
    ("BREAK a", (("", 1.0), BREAK, ("a", 1.0))),
    ("a BREAK BREAK b", (("a", 1.0), BREAK, ("", 1.0), BREAK, ("b", 1.0))),
    # inside brackets the web UI weights the marker too: then it is the word "BREAK", not a break
    ("(a BREAK b)", (("a", 1.1), ("BREAK", -1.1), ("b", 1.1))),
    ("(a BREAK b:-1)", (("a", -1.0), ("BREAK", 1.0), ("b", -1.0))),
    ("aBREAK b, breaks", (("aBREAK b, breaks", 1.0),)),
    ("ANDROID and android", (("ANDROID and android", 1.0),)),
    ("", (("", 1.0),)),
    ("()", (("", 1.0),)),
]


@pytest.mark.parametrize("prompt,pieces", PARSED)
def test_emphasis(prompt, pieces):
    parsed = parse_a1111(prompt)
    assert parsed.pieces == pieces
    assert parsed.loras == () and parsed.embeddings == ()


def test_loras_and_embeddings():
    assert parse_a1111("x <lora:ink:0.5> y <lora:styles/b> (z:1.2)<lora:c:-1.5e-1>") == ParsedPrompt(
        (("x  y  ", 1.0), ("z", 1.2)), (("ink", 0.5), ("styles/b", 1.0), ("c", -0.15)), ())
    assert parse_a1111("<lora: my ink : 0.5 >").loras == (("my ink", 0.5),)   # whitespace around parts dropped
    assert parse_a1111("<lora:ink:0.5:0.5>a").loras == (("ink", 0.5),)       # one scale for both: accepted
    assert parse_a1111("<lora:ink:1:1.0>").loras == (("ink", 1.0),)
    parsed = parse_a1111("embedding:foo, (embedding:sub/bar.pt:1.2) embedding:foo. an_embedding:no")
    assert parsed.pieces == (("foo, ", 1.0), ("sub/bar.pt", 1.2), (" foo. an_embedding:no", 1.0))
    assert parsed.embeddings == ("foo", "sub/bar.pt")  # first appearance order, once each; the full stop ends it
    assert parse_a1111("embedding:AND BREAK x").pieces == (("AND", 1.0), BREAK, ("x", 1.0))


def test_deep_brackets():
    weight = 1.0
    for _ in range(MAX_OPEN):
        weight *= 1.1
    assert parse_a1111("(" * MAX_OPEN + "dog").pieces == (("dog", weight),)
    with pytest.raises(ParamError, match=r"more than 100 '\(' open at once"):
        parse_a1111("(" * (MAX_OPEN + 1) + "dog")


REFUSED = [
    ("[a:b:0.5]", "prompt editing '[a:b:0.5]'", "('a' or 'b')"),
    ("x [a:0.5] y", "prompt editing '[a:0.5]'", "('a')"),
    ("[a::0.5]", "prompt editing '[a::0.5]'", r"escape the brackets as \[ \]"),
    ("[a:b:10]", "prompt editing '[a:b:10]'", "[from:to:when]"),
    ("[a: b :0.5 ]", "prompt editing", "('a' or 'b')"),  # the grammar allows whitespace around the number
    ("[ (x:1.2) : y : 3 ]", "prompt editing", "('(x:1.2)' or 'y')"),
    ("[a|b]", "alternation '[a|b]'", "(e.g. 'a')"),
    ("[|b]", "alternation '[|b]'", "(e.g. 'b')"),
    ("[(a:1.1)|b]", "alternation", "(e.g. '(a:1.1)')"),
    ("a [cat|dog|bird] b", "alternation", "swaps the words every step"),
    ("a cat AND a dog", "'AND'", "composable diffusion"),
    ("<lora:ink:0.5:1>", "text-encoder scale 0.5 and UNet scale 1", "one scale to both, so write <lora:ink:SCALE>"),
    ("<lora:ink:te=0.5>", "named arguments (te=, unet=, dyn=)", "one scale to both"),
    ("<lora:ink:1:unet=0.5>", "named arguments", "write <lora:NAME:SCALE>"),
    ("<lora:ink:1:1:8>", "3 arguments after the name", "dyn argument is not supported"),
    ("<hypernet:agm:1.1>", "extra-network tag '<hypernet:agm:1.1>' ('hypernet')", "only LoRA adapters"),
    ("<lyco:ink:1>", "('lyco')", "<lora:NAME:SCALE>"),
    ("<LoRA:ink:1>", "extra-network names are lowercase", "<lora:ink:1>"),
    ("<lora:>", "'<lora:>', which names no adapter", "<lora:NAME:SCALE>"),
    ("<lora::0.5>", "names no adapter", "<lora:NAME:SCALE>"),
    ("<lora:name:abc>", "scale 'abc' is not a number", "<lora:name:0.8>"),
    ("<lora:name:inf>", "scale 'inf' is not a number", "<lora:name:0.8>"),
    ("a <lora:name:0.5", "LoRA tag that does not close: '<lora:name:0.5'", "closing '>'"),
    ("<lora:a\nb:1>", "adapter name 'a\\nb' holds a line break", "on one line"),
    ("<lora:a <lora:b:1>", "does not close before the next '<'", "closing '>'"),
    ("(dog:.)", "weight '.'", "is not a number"),
    ("(dog:1.2.3)", "weight '1.2.3'", "write (text:1.2)"),
    ("(dog:" + "9" * 400 + ")", "past a float's range", "(text:1.2)"),
    ("((dog:" + "9" * 200 + "):" + "9" * 200 + ")", "the nested weights multiply past a float's range", "smaller"),
    ("embedding: dog", "'embedding:' with no name after it", "embedding:easynegative"),
    ("embedding:../secret", "embedding '../secret', which is not a name inside the embeddings folder", "'..'"),
    ("embedding:/etc/x", "not a name inside the embeddings folder", "embedding:folder/NAME"),
]


@pytest.mark.parametrize("prompt,found,fix", REFUSED)
def test_refusals_name_the_field(prompt, found, fix):
    with pytest.raises(ParamError) as e:
        parse_a1111(prompt, "negative_prompt")
    assert e.value.param == "negative_prompt"
    message = str(e.value)
    assert message.startswith("negative_prompt ") and "\n" not in message, message
    assert found in message and fix in message, message


@pytest.mark.parametrize("prompt", [r"\[a:b:0.5\]", r"\[a|b\]", "[a|b", "(a|b)", "[a:(b:1.2)]", "cat and dog"])
def test_look_alikes_are_read(prompt):
    parse_a1111(prompt)  # escaped, unclosed or in round brackets: not editing, not alternation


# -- chunks --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def preset():
    from diffgraph.models.tokenizer import preset_tokenizer

    tok = preset_tokenizer()

    def tokenize(texts):
        return tok(texts, add_special_tokens=False, truncation=False).input_ids

    ids = {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "comma": tok.convert_tokens_to_ids(",</w>")}
    dog = tokenize(["dog"])[0]
    assert len(dog) == 1 and ids["comma"] != tok.unk_token_id
    return tokenize, ids, dog[0]


def chunked(prompt, tokenize, ids, **kw):
    return chunk_tokens(parse_a1111(prompt).pieces, tokenize, **ids, **kw)


def test_long_prompt_without_comma(preset):
    tokenize, ids, dog = preset
    c = chunked("dog " * 120, tokenize, ids)
    bos, eos = ids["bos"], ids["eos"]
    assert c.ids == ((bos, *[dog] * 75, eos), (bos, *[dog] * 45, *[eos] * 31))
    assert c.weights == ((1.0,) * 77,) * 2
    assert c.token_count == 120 and c.embeddings == ()


def test_comma_near_the_boundary_moves_the_rest(preset):
    tokenize, ids, dog = preset
    bos, eos, comma = ids["bos"], ids["eos"], ids["comma"]
    c = chunked("dog " * 70 + ", " + "dog " * 49 + "(dog)", tokenize, ids)
    assert c.ids[0] == (bos, *[dog] * 70, comma, *[eos] * 5)   # the 4 dogs after the comma moved on
    assert c.ids[1] == (bos, *[dog] * 50, *[eos] * 26)
    assert c.weights[1][1:52] == (1.0,) * 49 + (1.1, 1.0)
    assert c.token_count == 75 + 50
    # a comma further back than `backtrack` tokens, or the rule turned off: the chunk is filled
    far = chunked("dog " * 40 + ", " + "dog " * 79, tokenize, ids)
    assert far.ids[0] == (bos, *[dog] * 40, comma, *[dog] * 34, eos) and far.token_count == 120
    for off in ({"backtrack": 0}, {"comma": None}):
        c = chunk_tokens(parse_a1111("dog " * 70 + ", " + "dog " * 49).pieces, tokenize, **{**ids, **off})
        assert c.ids[0] == (bos, *[dog] * 70, comma, *[dog] * 4, eos) and c.token_count == 120


def test_break_and_empty(preset):
    tokenize, ids, dog = preset
    bos, eos = ids["bos"], ids["eos"]
    empty = (bos, *[eos] * 76)
    c = chunked("", tokenize, ids)
    assert c.ids == (empty,) and c.weights == ((1.0,) * 77,) and c.token_count == 0
    c = chunked("(dog) BREAK dog", tokenize, ids)
    assert c.ids == ((bos, dog, *[eos] * 75), (bos, dog, *[eos] * 75)) and c.token_count == 76
    assert c.weights[0][:3] == (1.0, 1.1, 1.0) and c.weights[1][:3] == (1.0, 1.0, 1.0)
    assert chunked("dog BREAK", tokenize, ids).ids == ((bos, dog, *[eos] * 75),)   # no empty chunk at the end
    c = chunked("dog BREAK BREAK dog", tokenize, ids)
    assert c.ids[1] == empty and len(c.ids) == 3 and c.token_count == 151
    # ("BREAK", -1.1) from brackets is the word, weighted, as in the web UI (only ("BREAK", -1.0) breaks)
    word = chunked("(dog BREAK dog)", tokenize, ids)
    n = len(tokenize(["BREAK"])[0])
    assert len(word.ids) == 1 and word.token_count == n + 2
    assert word.weights[0][1:n + 3] == (1.1,) + (-1.1,) * n + (1.1,)


# a word-per-token tokenizer: exact positions without a real vocabulary
VOCAB = {"w": 5, ",": 6, "x": 7, "y": 8}
BOS, EOS = 1, 2
IDS = {"bos": BOS, "eos": EOS, "comma": 6}


def fake_tokenize(texts):
    return [[VOCAB[word] for word in text.replace(",", " , ").split()] for text in texts]


def test_matcher_longest_first():
    m = EmbeddingMatcher({"x": 2, "x y": 3}, fake_tokenize)
    assert m.find([7, 8, 7], 0) == ("x y", 3, 2)
    assert m.find([7, 8, 7], 2) == ("x", 2, 1)
    assert m.find([7, 8, 7], 1) is None
    with pytest.raises(ValueError, match="at least one"):
        EmbeddingMatcher({"x": 0}, fake_tokenize)
    with pytest.raises(ValueError, match="gives no tokens"):
        EmbeddingMatcher({"": 1}, fake_tokenize)


def test_embedding_that_does_not_fit_starts_the_next_chunk():
    m = EmbeddingMatcher({"x y": 4}, fake_tokenize)
    c = chunk_tokens(parse_a1111("w " * 73 + "(x y:1.5) w").pieces, fake_tokenize, **IDS, matcher=m)
    assert c.ids[0] == (BOS, *[5] * 73, EOS, EOS, EOS)
    assert c.ids[1][:7] == (BOS, 0, 0, 0, 0, 5, EOS)
    assert c.weights[1][:7] == (1.0, 1.5, 1.5, 1.5, 1.5, 1.0, 1.0)
    assert c.embeddings == (EmbeddingRef("x y", 1, 1, 4),) and c.token_count == 75 + 5
    fits = chunk_tokens(parse_a1111("w " * 71 + "x y").pieces, fake_tokenize, **IDS, matcher=m)
    assert fits.embeddings == (EmbeddingRef("x y", 0, 72, 4),) and len(fits.ids) == 1 and fits.token_count == 75
    with pytest.raises(ValueError, match="cannot stand in a prompt"):
        chunk_tokens(parse_a1111("x y").pieces, fake_tokenize, **IDS, chunk_length=3, matcher=m)


def test_embedding_moves_with_the_tokens_after_a_comma():
    m = EmbeddingMatcher({"x y": 4}, fake_tokenize)
    c = chunk_tokens(parse_a1111("w " * 60 + ", x y " + "w " * 30).pieces, fake_tokenize, **IDS, matcher=m)
    assert c.ids[0] == (BOS, *[5] * 60, 6, *[EOS] * 15)
    assert c.ids[1] == (BOS, 0, 0, 0, 0, *[5] * 30, *[EOS] * 42)
    assert c.embeddings == (EmbeddingRef("x y", 1, 1, 4),) and c.token_count == 75 + 34


def test_small_chunks():
    c = chunk_tokens((("w w , w w w", 1.0),), fake_tokenize, **IDS, chunk_length=4, backtrack=2)
    assert c.ids == ((BOS, 5, 5, 6, EOS, EOS), (BOS, 5, 5, 5, EOS, EOS)) and c.token_count == 7


def test_with_pad_and_pad_to():
    c = chunk_tokens((("w w", 1.0), BREAK, ("w " * 75, 1.0)), fake_tokenize, **IDS)
    assert with_pad(c, EOS, EOS) is c.ids
    padded = with_pad(c, EOS, 9)
    assert padded[0] == (BOS, 5, 5, EOS, *[9] * 73) and padded[1] == c.ids[1]   # a full chunk has no padding
    longer = pad_to(c, 4, BOS, EOS)
    assert isinstance(longer, TokenChunks) and longer.ids[:2] == c.ids and longer.weights[:2] == c.weights
    assert longer.ids[2:] == ((BOS, *[EOS] * 76),) * 2 and longer.weights[2:] == ((1.0,) * 77,) * 2
    assert longer.token_count == c.token_count and longer.embeddings == c.embeddings
    assert with_pad(longer, EOS, 9)[3] == (BOS, EOS, *[9] * 75)
    assert pad_to(c, 2, BOS, EOS) is c and pad_to(c, 1, BOS, EOS) is c


# -- the truncation warning --------------------------------------------------------------------------------
def test_prompt_truncation_warning_names_counts_not_the_prompt(caplog):
    from diffgraph.models.families.base import FamilyAdapter
    from diffgraph.models.tokenizer import preset_tokenizer

    tokenizer = preset_tokenizer()
    prompt = "secretword " * 200
    with caplog.at_level(logging.WARNING, logger="diffgraph"):
        FamilyAdapter().tokenize(SimpleNamespace(tokenizers=[tokenizer]), [prompt])
    (record,) = [r for r in caplog.records if "truncated" in r.getMessage()]
    message = record.getMessage()
    assert "secretword" not in message
    dropped = len(tokenizer(prompt).input_ids) - tokenizer.model_max_length
    assert f"CLIP reads {tokenizer.model_max_length} tokens" in message and f"{dropped} dropped" in message
