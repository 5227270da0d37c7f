"""stages.examples: rows made into token ids the way a user's own script makes them, lengths taken from the data,
and a reward model that scores a text under plain transformers exactly as the pipeline scored it."""
from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset
from torch.testing import assert_close
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from hybridcore import chat
from hybridcore.errors import InputError
from hybridcore.forward import sequence_scores, sequences
from hybridcore.models import build_preset, load_sequence_scorer, save_model, train_tokenizer
from stages import examples

SYS = {"role": "system", "content": "you add numbers"}


def ask(a, b):
    return {"role": "user", "content": f"mia has {a} pears and gets {b} more. total:"}


def said(text):
    return {"role": "assistant", "content": text}


TEXTS = [f"mia has {a} pears and gets {b} more. total: {a + b}" for a in range(10) for b in range(10)]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS + ["you add numbers system user assistant"], 384)


@pytest.fixture(scope="module")
def rm_folder(tok, tmp_path_factory):
    """A random micro reward model saved as an HF folder with its tokenizer (pad != eos)."""
    folder = tmp_path_factory.mktemp("rm") / "model"
    save_model(build_preset("micro", tok, seed=0), tok, folder)
    torch.manual_seed(1)
    rm = load_sequence_scorer(str(folder), pad_token_id=tok.pad_token_id)
    rm.save_pretrained(folder, safe_serialization=True)
    return folder


def test_standard_sft_rows(tok):
    ds = Dataset.from_list([{"prompt": "mia has 3 pears and gets 4 more. total:", "response": " 7"}])
    ex = examples.sft_examples(tok, ds, False, None, "data.sft", 256)
    assert ex.prompts[0] == tok("mia has 3 pears and gets 4 more. total:")["input_ids"]
    assert ex.responses[0] == tok(" 7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ex.masks[0] == [1] * len(ex.responses[0]) and ex.longest_reply == len(ex.responses[0])


def test_conversational_sft_trains_every_assistant_turn_and_nothing_else(tok):
    """The prompt part is what a rollout feeds the model for the first turn; the loss mask covers the two
    assistant turns (content + end of turn) and not the user turn between them."""
    turns = [SYS, ask(3, 4), said("7"), ask(1, 2), said("3")]
    ex = examples.sft_examples(tok, Dataset.from_list([{"messages": turns}]), True, None, "data.sft", 256)
    assert ex.prompts[0] == tok.apply_chat_template(turns[:2], add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"]
    trained = [t for t, m in zip(ex.responses[0], ex.masks[0]) if m]
    assert tok.decode(trained) == "7<|im_end|>\n3<|im_end|>\n"
    assert 0 in ex.masks[0]  # the second user turn is in the response part, untrained
    assert ex.longest_reply == len(chat.ids(tok, "7<|im_end|>\n"))


def test_lengths_follow_the_data_and_explicit_limits_hold(tok, capsys):
    """A null max_seq_len is the longest row (and said once on stderr); an explicit one refuses longer rows naming
    the row; the model's positions cap a derived one."""
    rows = [{"prompt": "mia has 3 pears. total:", "response": " 3"}, {"prompt": TEXTS[0], "response": " 1"}]
    ds = Dataset.from_list(rows)
    ex = examples.sft_examples(tok, ds, False, None, "data.sft (built-in)", 256)
    longest = max(len(a) + len(b) for a, b in zip(ex.prompts, ex.responses))
    assert f"sft.max_seq_len: {longest} (the longest row of data.sft (built-in)" in capsys.readouterr().err
    examples.sft_examples(tok, ds, False, longest, "data.sft", 256)
    with pytest.raises(InputError, match=rf"data.sft row 2: {longest} tokens long, over sft.max_seq_len="
                                         rf"{longest - 1} \(expected at most {longest - 1}"):
        examples.sft_examples(tok, ds, False, longest - 1, "data.sft", 256)
    with pytest.raises(InputError, match=rf"row 2: {longest} tokens long, over the model's {longest - 1} positions"):
        examples.sft_examples(tok, ds, False, None, "data.sft", longest - 1)


def test_max_new_tokens_from_the_stages_manifests(tmp_path):
    """Null max_new_tokens = the longest response the SFT and RM stages recorded + 25 % (at least 2 more), never
    past the context left by the longest prompt; an explicit value stays."""
    for stage, n in (("sft", 9), ("reward", 13)):
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "manifest.json").write_text(json.dumps({"metrics": {"longest_response_tokens": n}}))
    inputs = {s: tmp_path / s for s in ("sft", "reward")}
    assert examples.max_new_tokens(None, inputs, "ppo.max_new_tokens", 256, [[1] * 10]) == 13 + 4
    assert examples.max_new_tokens(None, {"sft": inputs["sft"]}, "ppo.max_new_tokens", 256, [[1] * 10]) == 9 + 3
    assert examples.max_new_tokens(None, inputs, "ppo.max_new_tokens", 20, [[1] * 10]) == 10
    assert examples.max_new_tokens(5, inputs, "ppo.max_new_tokens", 256, [[1] * 10]) == 5


def test_prompts_as_a_user_script_builds_them(tok):
    turns = [SYS, ask(2, 2)]
    ps = examples.prompt_set(tok, Dataset.from_list([{"prompt": turns, "answer": "4"}]), "data.prompts")
    assert ps.ids[0] == tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]
    assert ps.texts[0].endswith("<|im_start|>assistant\n") and ps.answers() == ["4"]
    std = examples.prompt_set(tok, Dataset.from_list([{"prompt": "q:"}]), "data.prompts")
    assert std.ids[0] == tok("q:")["input_ids"] and std.answers() is None


@torch.no_grad()
@pytest.mark.parametrize("conversational", [False, True])
def test_the_exported_rm_scores_texts_as_the_pipeline_does(tok, rm_folder, conversational):
    """For standard rows (prompt + response) and conversations (the rendered chat), plain
    AutoModelForSequenceClassification + the folder's tokenizer gives the pipeline's score within 1e-4."""
    if conversational:
        rows = [{"prompt": [SYS, ask(a, b)], "chosen": [said(str(a + b))], "rejected": [said(str(a + b + 1))]}
                for a, b in ((3, 4), (9, 9), (1, 0))]
    else:
        rows = [{"prompt": f"mia has {a} pears and gets {b} more. total:", "chosen": f" {a + b}",
                 "rejected": f" {a + b + 11}"} for a, b in ((3, 4), (9, 9), (1, 0))]
    pairs = examples.pair_examples(tok, Dataset.from_list(rows), conversational, None, "data.preferences", 256)
    ours_model = load_sequence_scorer(str(rm_folder), pad_token_id=tok.pad_token_id).eval()
    ours = sequence_scores(ours_model, sequences(pairs.chosen + pairs.rejected, tok.pad_token_id))
    plain = AutoModelForSequenceClassification.from_pretrained(rm_folder).eval()
    plain_tok = AutoTokenizer.from_pretrained(rm_folder)
    for i, row in enumerate(rows + rows):
        side = "chosen" if i < len(rows) else "rejected"
        if conversational:
            ids = plain_tok.apply_chat_template(row["prompt"] + row[side], tokenize=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
        else:
            ids = plain_tok(row["prompt"] + row[side], return_tensors="pt")["input_ids"]
        assert_close(ours[i], plain(input_ids=ids).logits[0, 0].float(), atol=1e-4, rtol=0)
