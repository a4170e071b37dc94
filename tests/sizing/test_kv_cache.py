"""The KV cache a job holds, as sized on the meta device, against real caches of tiny models on the cpu."""
from __future__ import annotations

from pathlib import Path

import pytest

from oom_magic.sizing.probe import probe_job
from tests.sizing.families import FAMILIES, build, cache_storage_bytes

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

BATCH, PROMPT, NEW = 2, 12, 7


def _saved(family: str, root: Path) -> Path:
    folder = root / family
    if not folder.exists():
        build(family).config.save_pretrained(folder)
    return folder / "config.json"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_cache_after_the_prompt_and_at_the_context_equals_a_real_generate_to_the_byte(family, tmp_path):
    model = build(family)
    ids = torch.randint(3, 256, (BATCH, PROMPT))
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            start = torch.zeros(BATCH, 1, dtype=torch.long)
            after_prompt = model(input_ids=ids, decoder_input_ids=start, use_cache=True).past_key_values
            out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 return_dict_in_generate=True)
            context = PROMPT + NEW  # encoder tokens + the decoder's NEW held tokens (start + NEW - 1)
        else:
            after_prompt = model(input_ids=ids, use_cache=True).past_key_values
            out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 return_dict_in_generate=True)
            context = PROMPT + NEW - 1  # the last token generated is never fed back
    real_after_prompt = cache_storage_bytes(after_prompt)
    real_at_context = cache_storage_bytes(out.past_key_values)
    assert real_after_prompt > 0 and real_at_context > 0

    probe = probe_job(_saved(family, tmp_path), "float32", batch=BATCH, prompt=PROMPT, context=context)

    assert (probe.kv_after_prompt, probe.kv_at_context) == (real_after_prompt, real_at_context)
