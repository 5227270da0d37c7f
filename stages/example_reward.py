"""An example `ppo.reward_function` for the built-in task: 1.0 when the response's first integer is the row's
`answer`, else 0.0. `hybrid-rlhf example-data DIR` copies it to DIR/reward.py beside the data files.

The contract: NAME(prompts, responses, rows) -> one float per response. prompts are the prompts as the policy saw
them (text; conversational prompts rendered with the chat template), responses the decoded answers (special tokens
off), rows the prompt file's rows with every column (an `answer` column reaches the verifier this way).
"""
import re


def correct(prompts: list[str], responses: list[str], rows: list[dict]) -> list[float]:
    out = []
    for response, row in zip(responses, rows):
        found = re.search(r"-?\d+", response)
        out.append(1.0 if found is not None and found.group(0) == str(row["answer"]).strip() else 0.0)
    return out
