"""PP=2 on CPU gloo: one step in flight vs two, interleaved on one engine."""
import os, tempfile, time
from transformers import LlamaConfig, LlamaForCausalLM
from tests.conftest import randomize, save_tokenizer
from kvserve import LLM, SamplingParams

def main():
    d = tempfile.mkdtemp()
    cfg = dict(vocab_size=1000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
               num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    m = LlamaForCausalLM(LlamaConfig(**cfg)); randomize(m, seed=0); m.save_pretrained(d); save_tokenizer(d, 1000)
    def prompts_for(round_):  # distinct every round: no prefix-cache hits
        return [{"prompt_token_ids": [(7 * i + 31 * round_ + j * (round_ + 2)) % 1000 for j in range(128)]}
                for i in range(16)]
    prompts = prompts_for(99)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(d, pipeline_parallel_size=2, dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=128)
    core = llm.engine.core
    llm.generate(prompts[:2], params)
    results = {1: [], 2: []}
    for rep in range(3):
        for depth in (1, 2):
            core.max_batches_in_flight = depth
            batch = prompts_for(2 * rep + depth)
            t = time.perf_counter(); llm.generate(batch, params); results[depth].append(time.perf_counter() - t)
    for depth, times in results.items():
        print(f"depth {depth}: " + " ".join(f"{x:.2f}" for x in times) + f" s  (16 prompts x 128 in, 16 out)")
    print("most in flight", core.most_batches_in_flight, "load", os.getloadavg())
    llm.engine.shutdown()

if __name__ == "__main__":
    main()
