"""The text a reference model's greedy continuation of a token-id prompt decodes to (the file's
own tokenizer), for the serve tests that compare `vramd serve`'s completion with it; refuses a
near-tie (a margin under 0.05), where f16 rounding could pick either token."""

import numpy as np


def greedy_text(ref, path, prompt: list[int], n: int) -> str:
    from vramd.engine.tokenizer import Tokenizer
    from vramd.model.gguf_check import validate_gguf
    ids, logits = ref.greedy_logits(prompt, n, kv_dtype=np.float16)
    assert min(np.partition(row, -2)[-1] - np.partition(row, -2)[-2] for row in logits) > 0.05, "a near-tie"
    tok = Tokenizer.from_metadata(validate_gguf(path).metadata)
    whole, head = tok.decode(prompt + ids), tok.decode(prompt)   # as a continuation (SPM's leading space kept)
    assert whole.startswith(head)
    return whole[len(head):]
