"""Vision-language models on the paged engine against transformers (fp32, CPU): logits of
every generated position within fp32 tolerance and identical greedy ids, for prompts with
0, 1 and 3 images."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.vision_models import drawn_images, hf_inputs, placeholder_ids, save_model

NUM_TOKENS = 6


def _prompt(kind: str, num_images: int) -> list[int]:
    ids = [1, 10, 11]
    for i in range(num_images):
        ids += placeholder_ids(kind) + [20 + i, 21]
    return ids + [30, 31]


def hf_greedy(model, kind: str, prompt: list[int], images) -> tuple[list[int], torch.Tensor]:
    """Greedy ids and the log-softmax of each step's logits [NUM_TOKENS, V]."""
    inputs = hf_inputs(kind, prompt, images)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NUM_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    ids = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return ids, torch.log_softmax(torch.cat(out.logits).float(), dim=-1)


@pytest.fixture(scope="module", params=["llava", "llava_siglip", "qwen2_vl", "qwen2_5_vl"])
def vl_model(request, tmp_path_factory):
    directory, model = save_model(request.param, str(tmp_path_factory.mktemp(request.param)))
    return request.param, directory, model


def test_logits_and_greedy_ids_match_transformers(vl_model):
    kind, directory, hf_model = vl_model
    llm = LLM(model=directory, kv_cache_memory="8MiB", max_model_len=512, max_num_batched_tokens=512)
    images = drawn_images()
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    for num_images in (0, 1, 3):
        prompt = _prompt(kind, num_images)
        expected_ids, expected_logprobs = hf_greedy(hf_model, kind, prompt, images[:num_images])
        request = {"prompt_token_ids": prompt}
        if num_images:
            request["multi_modal_data"] = {"image": images[:num_images]}
        (output,) = llm.generate(request, params)
        completion = output.outputs[0]
        assert completion.token_ids == expected_ids, (kind, num_images)
        for step, entry in enumerate(completion.logprobs):
            for token_id, logprob in entry.items():
                assert logprob == pytest.approx(expected_logprobs[step, token_id].item(), abs=1e-4), \
                    (kind, num_images, step)
