"""Chat templates: conversations rendered the way the tokenizer's own template says, split into what the model
reads and what it is trained to write, and the token that ends an assistant turn.

A conversation is a list of {"role", "content"} turns. Training ids are built segment by segment: the text before
each assistant turn (ending in the template's generation prompt) and the assistant turn itself (content plus the
template's end-of-turn text) are tokenized separately, so the prompt part is exactly the ids a rollout feeds the
model (`apply_chat_template(prompt, add_generation_prompt=True)`), and only assistant segments carry loss.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from hybridcore.errors import InputError

ROLES = ("system", "user", "assistant")

# Built-in templates for tokenizers that lack one. chatml needs <|im_start|> and <|im_end|> as tokens (the tiny
# preset's tokenizer has them); plain works with any tokenizer: role-labelled lines, assistant turns end with EOS.
BUILTIN = {
    "chatml": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
               "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
               "{% endif %}"),
    "plain": ("{% for message in messages %}{{ message['role'] + ': ' + message['content'] }}"
              "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"),
}
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
_PROBE = "\u2063reply\u2063"  # invisible separators around a word: content no template rewrites


def attach(tok, spec: Optional[str], field: str = "data.chat_template") -> None:
    """Give `tok` the template `spec` names (a built-in name or a .jinja file); None keeps the tokenizer's own."""
    if spec is None:
        return
    if spec in BUILTIN:
        if spec == "chatml":
            missing = [t for t in CHATML_TOKENS if t not in tok.get_vocab()]
            if missing:
                raise InputError(f"{field}: chatml needs the tokens {', '.join(missing)}, which this tokenizer "
                                 f"lacks (expected plain, or a .jinja file written for this tokenizer)")
        tok.chat_template = BUILTIN[spec]
        return
    path = Path(spec)
    if not path.is_file():
        raise InputError(f"{field}: {spec!r} is neither a built-in template ({', '.join(BUILTIN)}) nor a file "
                         f"(expected a name or the path of a Jinja template)")
    try:
        tok.chat_template = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{field}: {spec} is not UTF-8 text (expected a Jinja chat template)") from None


def has_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None))


def require_template(tok, where: str) -> None:
    if not has_template(tok):
        raise InputError(f"{where}: the rows are conversations but the tokenizer has no chat template; expected "
                         f"data.chat_template naming one ({', '.join(BUILTIN)}, or a .jinja file)")


def render(tok, messages: list[dict], generation_prompt: bool = False, where: str = "data") -> str:
    """The template's text of `messages`; a template that fails is an InputError naming `where`."""
    require_template(tok, where)
    if not messages:
        return ""
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja raises TemplateError (raise_exception in templates), TypeError, ...
        detail = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise InputError(f"{where}: the chat template failed to render this conversation ({type(e).__name__}: "
                         f"{detail}); expected roles and turns the template accepts") from None


def ids(tok, text: str) -> list[int]:
    """Template text to ids the way apply_chat_template(tokenize=True) does: the template writes any BOS itself."""
    return tok(text, add_special_tokens=False)["input_ids"] if text else []


def segments(tok, messages: list[dict], where: str = "data") -> list[tuple[str, bool]]:
    """[(text, trained)] that concatenate to the rendered conversation; each assistant turn is one trained piece,
    everything before it (down to the generation prompt) an untrained one."""
    full = render(tok, messages, where=where)
    out, done = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tok, messages[:i], generation_prompt=True, where=where) if i else ""
        upto = render(tok, messages[: i + 1], where=where)
        if not (upto.startswith(before) and full.startswith(upto) and len(before) >= done):
            raise InputError(f"{where}: the chat template does not render this conversation turn by turn (turn "
                             f"{i + 1}'s text is not a prefix of the whole), so its assistant tokens cannot be "
                             f"told apart; expected a template that only appends as turns are added")
        out += [(full[done:len(before)], False), (full[len(before):len(upto)], True)]
        done = len(upto)
    out.append((full[done:], False))
    return [(t, trained) for t, trained in out if t]


def encode(tok, messages: list[dict], where: str = "data") -> tuple[list[int], list[int]]:
    """(ids, trained mask) of a conversation, segment by segment (see the module docstring)."""
    all_ids, mask = [], []
    for text, trained in segments(tok, messages, where):
        piece = ids(tok, text)
        all_ids += piece
        mask += [int(trained)] * len(piece)
    return all_ids, mask


def end_of_turn_id(tok) -> Optional[int]:
    """The special token the template writes right after an assistant's words (<|im_end|>, <|eot_id|>, EOS...),
    found by rendering a probe; None without a template or when that text does not start with a special token."""
    if not has_template(tok):
        return None
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}],
                                       tokenize=False)
    except Exception:  # a template that refuses the probe's shape still chats; only EOS stops it then
        return None
    at = text.find(_PROBE)
    if at < 0:
        return None
    after = ids(tok, text[at + len(_PROBE):])
    special = set(getattr(tok, "all_special_ids", ())) | set(getattr(tok, "added_tokens_decoder", {}) or {})
    return after[0] if after and after[0] in special else None


def stop_ids(tok) -> list[int]:
    """Tokens that end a response: EOS and the template's end-of-turn token."""
    out = [] if getattr(tok, "eos_token_id", None) is None else [tok.eos_token_id]
    eot = end_of_turn_id(tok)
    if eot is not None and eot not in out:
        out.append(eot)
    return out
