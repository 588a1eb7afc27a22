"""Self-distillation text for `kvserve train-drafter --method eagle`: the model answers a few
hundred varied prompts (topics x task templates, none of them W5's low-repetition prompts)
greedily, and each chat-formatted prompt plus its answer becomes one line of a .jsonl file.

    python benchmarks/results/cpu-w5-eagle/make_training_data.py --out train.jsonl --max-tokens 192
"""

from __future__ import annotations

import argparse
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
    "dinosaurs", "budgeting", "marathon training", "the printing press", "penguins", "a lighthouse keeper",
    "a lost umbrella", "a talking tree", "a space pirate", "a shy ghost", "owls", "rain", "the desert",
    "a city at night", "a clockmaker", "winter mornings", "a camping trip", "a museum", "a job interview",
    "moving to a new city", "learning to swim", "a birthday party", "writing an essay", "saving money",
    "cooking pasta", "a road trip", "a first day at school", "keyboards", "compilers", "spreadsheets",
    "passwords", "sorting algorithms", "the blockchain", "bicycles", "electricity", "magnets", "the seasons",
]
TEMPLATES = [
    "Explain {} in simple terms.",
    "Write a short paragraph about {}.",
    "What are the most interesting facts about {}?",
    "Give three tips related to {}.",
    "Write a short story about {}.",
    "Describe {} to a ten-year-old.",
    "Write a short poem about {}.",
    "What are the pros and cons of {}?",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--num-prompts", type=int, default=0, help="the first N prompts (0: all)")
    parser.add_argument("--half", type=int, choices=[0, 1], default=0,
                        help="which half of the topic x template pairs (each topic takes every other template)")
    args = parser.parse_args()
    prompts = [t.format(topic) for i, topic in enumerate(TOPICS) for t in TEMPLATES[(i + args.half) % 2 :: 2]]
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
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
