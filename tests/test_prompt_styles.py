"""prompt_styles.py: AUTOMATIC1111's styles.csv read with bounds (each refusal one line naming the file, and the line
of a malformed row), and its merge rule (modules/styles.py's merge_prompts: `{prompt}` substituted, else appended
after ", " with empty sides left out)."""

import pytest

from diffgraph.prompt_styles import MAX_STYLES_BYTES, PromptStyle, StyleBook, StyleError, merge, read_styles


def test_merge_substitutes_or_appends_as_a1111():
    assert merge("a drawing of {prompt}, centered", "a fox") == "a drawing of a fox, centered"
    assert merge("{prompt}, {prompt}", " a fox ") == " a fox ,  a fox "  # substituted as it is, never stripped
    assert merge(" ink lines ", " a fox ") == "a fox, ink lines"
    assert merge("ink lines", "") == "ink lines" and merge("", "a fox") == "a fox" and merge("  ", " ") == ""


def test_a_book_applies_styles_in_order_and_names_the_unknown():
    book = StyleBook("s.csv", (PromptStyle("a", "A {prompt}", ""), PromptStyle("b", "B", "nb {prompt}")))
    assert book.apply("p", "n", ["a", "x", "b", "a", "x"]) == ("A A p, B", "nb n", ("x",))  # a twice: twice
    assert book.apply("p", "n", ["b", "a"]) == ("A p, B", "nb n", ())
    assert book.apply("p", "", []) == ("p", "", ())
    with pytest.raises(StyleError, match="prompt with style 'a' applied is longer than 4 bytes") as e:
        book.apply("abcd", "", ["a"], max_bytes=4)
    assert e.value.field == "prompt"
    book = StyleBook("s.csv", (PromptStyle("twice", "{prompt}{prompt}", "é"),))
    with pytest.raises(StyleError) as e:  # 2**64 copies are never built
        book.apply("x" * 10, "", ["twice"] * 64, max_bytes=1000)
    assert e.value.field == "prompt"
    with pytest.raises(StyleError) as e:  # counted in UTF-8 bytes
        book.apply("", "é" * 2, ["twice"], max_bytes=5)
    assert e.value.field == "negative_prompt"


def test_read_styles_as_a1111_reads_them(tmp_path):
    path = tmp_path / "styles.csv"
    path.write_bytes(b"\xef\xbb\xbfname, prompt, negative_prompt\r\n"  # a BOM, spaces after the commas, CRLF
                     b'one, "a, b", "multi\r\nline"\r\n\r\n# note,x,y\r\ntwo,only prompt\r\none,again,\r\n')
    book = read_styles(str(path))
    assert book.styles == (PromptStyle("one", "again", ""), PromptStyle("two", "only prompt", ""))
    old = tmp_path / "old.csv"
    old.write_text("name,text\nlegacy,from the old format\n")  # AUTOMATIC1111's first format
    assert read_styles(str(old)).listing() == [{"name": "legacy", "prompt": "from the old format",
                                                "negative_prompt": ""}]
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert read_styles(str(empty)).styles == ()


@pytest.mark.parametrize("data, needle", [
    (b"name,prompt\nink,lines,extra\n", "line 2: the row has 3 fields, the header 2"),
    (b"name,prompt,negative_prompt\nok,a,b\nink\n", "line 3: style 'ink' has no prompt field"),
    (b"title,prompt\nink,lines\n", "line 1: the header 'title,prompt' lacks the name or prompt column"),
    (b'name,prompt\nink,"unterminated\n', "line 2: not CSV"),
    (b'name,prompt\nink,"a"b\n', "line 2: not CSV"),
    (b"name,prompt\nink,\xff\n", "not UTF-8 text (byte 16)"),
    (b"name,prompt\n" + b"x" * MAX_STYLES_BYTES, "larger than 1 MiB"),
])
def test_a_malformed_file_is_refused_in_one_line_naming_it(tmp_path, data, needle):
    path = tmp_path / "mine.csv"
    path.write_bytes(data)
    with pytest.raises(ValueError) as e:
        read_styles(str(path))
    message = str(e.value)
    assert message.startswith(f"styles {str(path)!r}") and needle in message and "\n" not in message, message


def test_a_missing_file_is_refused_naming_it(tmp_path):
    from diffgraph.server import ServerConfig
    with pytest.raises(ValueError, match="styles '.*nowhere.csv': cannot be read"):
        ServerConfig(model="digits", styles=str(tmp_path / "nowhere.csv"))
