from server.engine.detokenize import TextStream


def stream(tokenizer, text: str, stop=()):
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = TextStream(tokenizer, stop)
    pieces = []
    for t in ids:
        pieces.append(d.push(t))
        if d.stopped:
            break
    pieces.append(d.finish())
    return d, pieces


def test_streamed_pieces_join_to_the_decoded_text(smollm2_tokenizer):
    text = "Héllo wörld — naïve café ☕ 日本語 done."
    d, pieces = stream(smollm2_tokenizer, text)
    assert "".join(pieces) == d.text == smollm2_tokenizer.decode(
        smollm2_tokenizer.encode(text, add_special_tokens=False)
    )
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_the_text_and_is_never_streamed(smollm2_tokenizer):
    d, pieces = stream(smollm2_tokenizer, "The answer is 42.\nObservation: done", stop=("Observation:",))
    assert d.stopped and d.text == "The answer is 42.\n"
    assert "".join(pieces) == d.text
    assert not any("Obs" in p for p in pieces)


def test_a_held_back_prefix_of_a_stop_string_is_released_when_it_diverges(smollm2_tokenizer):
    d, pieces = stream(smollm2_tokenizer, "see Obsidian rocks", stop=("Observation:",))
    assert not d.stopped and "".join(pieces) == d.text == "see Obsidian rocks"
