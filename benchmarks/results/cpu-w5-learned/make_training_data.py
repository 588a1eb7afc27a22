"""Self-distillation text for `kvserve train-drafter`: the model answers varied prompts
(none of them W5's held-out low-repetition prompts) and each chat-formatted prompt plus its
greedy answer becomes one line of a .jsonl file, so the heads learn from hidden states
the model produces while answering, as at inference.

    python benchmarks/results/cpu-w5-learned/make_training_data.py --out train.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json

from kvserve.benchmarks.spec_decode import LOW_REPETITION_PROMPTS
from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams

TOPICS = [
    "photosynthesis", "the French Revolution", "black holes", "compound interest", "volcanoes",
    "the human heart", "machine learning", "bread baking", "electric cars", "the Roman Empire",
    "honey bees", "climate change", "the stock market", "sleep", "recycling", "the moon landing",
    "coffee", "earthquakes", "the internet", "chess", "rainforests", "public speaking",
    "gardening", "the piano", "solar panels", "friendship", "time management", "the ocean tides",
    "dinosaurs", "budgeting", "marathon training", "the printing press",
]
TEMPLATES = [
    "Explain {} in simple terms.",
    "Write a short paragraph about {}.",
    "What are the most interesting facts about {}?",
    "Give three tips related to {}.",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-tokens", type=int, default=192)
    args = parser.parse_args()
    prompts = [t.format(topic) for topic, t in zip(TOPICS, itertools.cycle(TEMPLATES))]
    prompts += [t.format(topic) for topic, t in zip(TOPICS[::-1], itertools.cycle(TEMPLATES[2:] + TEMPLATES[:2]))]
    assert not set(prompts) & set(LOW_REPETITION_PROMPTS)
    llm = LLM(max_num_seqs=64)
    tokenizer = llm.get_tokenizer()
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    outputs = llm.generate(chats, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    with open(args.out, "w") as f:
        for chat, output in zip(chats, outputs):
            f.write(json.dumps({"text": chat + output.outputs[0].text}) + "\n")


if __name__ == "__main__":
    main()
