"""hybridcore.chat: templates attached, conversations split into trained and untrained pieces exactly as
apply_chat_template renders and tokenizes them, and the token that ends an assistant turn."""
from __future__ import annotations

import pytest

from hybridcore import chat
from hybridcore.errors import InputError
from hybridcore.models import EOS, train_tokenizer

TURNS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "mia has 3 pears. total:"},
         {"role": "assistant", "content": "3"}, {"role": "user", "content": "and 4 more?"},
         {"role": "assistant", "content": "7 pears"}]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["mia has 3 pears and 4 more. total: 7 be brief system user assistant"] * 4, 320)


def test_the_preset_tokenizer_carries_chatml_and_stops_at_its_end_of_turn(tok):
    """train_tokenizer's template is chatml; the stop ids are EOS and <|im_end|>, each one token."""
    assert tok.chat_template == chat.BUILTIN["chatml"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert chat.end_of_turn_id(tok) == im_end
    assert chat.stop_ids(tok) == [tok.eos_token_id, im_end]
    assert tok.decode(tok("<|im_start|>user<|im_end|>")["input_ids"], skip_special_tokens=True) == "user"


def test_segments_are_the_rendered_text_and_only_assistant_turns_train(tok):
    """The pieces concatenate to the rendered conversation; the trained ones are each assistant's content + its end
    of turn; encode's ids equal apply_chat_template's tokenization, and its mask covers exactly those pieces."""
    pieces = chat.segments(tok, TURNS)
    assert "".join(t for t, _ in pieces) == tok.apply_chat_template(TURNS, tokenize=False)
    assert [t for t, trained in pieces if trained] == ["3<|im_end|>\n", "7 pears<|im_end|>\n"]
    ids, mask = chat.encode(tok, TURNS)
    assert len(ids) == len(mask)
    first = mask.index(1)
    assert ids[:first] == tok.apply_chat_template(TURNS[:2], add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "3<|im_end|>\n7 pears<|im_end|>\n"


def test_plain_template_ends_assistant_turns_with_eos(tok):
    """The `plain` built-in works with any tokenizer: EOS ends an assistant turn and is its stop token."""
    chat.attach(tok, "plain")
    try:
        assert chat.end_of_turn_id(tok) == tok.eos_token_id
        assert chat.stop_ids(tok) == [tok.eos_token_id]
        assert [t for t, trained in chat.segments(tok, TURNS) if trained] == [f"3{EOS}\n", f"7 pears{EOS}\n"]
    finally:
        chat.attach(tok, "chatml")


def test_a_template_file_and_its_errors(tok, tmp_path):
    """attach reads a .jinja file; an unknown name, a missing file and chatml without its tokens are one line."""
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}", encoding="utf-8")
    chat.attach(tok, str(f))
    assert chat.render(tok, TURNS[:2]) == "system> be brief\nuser> mia has 3 pears. total:\n"
    assert chat.end_of_turn_id(tok) is None and chat.stop_ids(tok) == [tok.eos_token_id]
    chat.attach(tok, "chatml")
    with pytest.raises(InputError, match=r"data.chat_template: 'nope' is neither a built-in template"):
        chat.attach(tok, "nope")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    raw = Tokenizer(models.WordLevel({"a": 0, "<e>": 1}, unk_token="a"))  # a user's tokenizer without chatml tokens
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    other = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<e>")
    with pytest.raises(InputError, match=r"chatml needs the tokens <\|im_start\|>, <\|im_end\|>"):
        chat.attach(other, "chatml")


def test_render_failures_and_a_missing_template_are_one_line(tok):
    """A template that raises, and conversations for a tokenizer with no template, are InputErrors naming where."""
    tok.chat_template = "{{ raise_exception('only user turns, please') }}"
    try:
        with pytest.raises(InputError, match=r"row 3: the chat template failed .*only user turns, please"):
            chat.render(tok, TURNS, where="row 3")
        tok.chat_template = None
        with pytest.raises(InputError, match=r"row 3: the rows are conversations but the tokenizer has no chat "
                                             r"template; expected data.chat_template"):
            chat.render(tok, TURNS, where="row 3")
    finally:
        chat.attach(tok, "chatml")


def test_a_template_that_rewrites_history_is_refused(tok):
    """A template whose rendering of a turn is not a prefix of the whole (it edits earlier turns) cannot mark
    assistant tokens: refused with one line."""
    tok.chat_template = ("{% for m in messages %}{% if loop.last %}{{ m['content'] }}{% else %}[{{ m['role'] }}]"
                         "{% endif %}{% endfor %}")
    try:
        with pytest.raises(InputError, match=r"does not render this conversation turn by turn"):
            chat.segments(tok, TURNS)
    finally:
        chat.attach(tok, "chatml")
