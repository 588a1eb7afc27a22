"""The KV cache report (`/debug/kv`, the Prometheus gauges) against values worked out by
hand for a scripted set of requests: a prompt whose blocks stay cached, a second prompt
that hits two of them, and an n=2 request whose samples share blocks until copy-on-write."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

from kvserve import LLM, SamplingParams
from kvserve.engine.kv_report import kv_cache_report, summarize_reports

BLOCK = 4
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _steps(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> list[dict]:
    reports = []
    llm.generate([{"prompt_token_ids": p} for p, _ in requests], [s for _, s in requests],
                 on_step=lambda: reports.append(kv_cache_report(llm.engine.stats(), llm.engine.client.info)))
    return reports


def test_blocks_sharing_and_fragmentation_by_hand(save_hf_model) -> None:
    llm = LLM(model=save_hf_model(LlamaForCausalLM(LlamaConfig(**SMALL))), block_size=BLOCK,
              kv_cache_memory="1MiB", max_model_len=64, enable_prefix_caching=True)
    info = llm.engine.client.info
    # fp32, 2 layers x (K and V) x 2 KV heads x 16 dims x 4 bytes, 4 tokens a block.
    assert info.kv_bytes_per_block == 2 * 2 * 2 * 16 * 4 * BLOCK
    total = info.num_blocks
    prompt = list(range(10, 20))
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    three = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    # 10 tokens: blocks [10-13] [14-17] full and cached once the request ends, [18-19] not.
    (done,) = _steps(llm, [(prompt, one)])
    assert done["blocks"] == {"total": total, "used": 0, "cached": 2, "free": total - 2}

    # A: the first 8 tokens hit both cached blocks, 3 more take a third block (1 slot left).
    # B: 6 tokens in 2 blocks (2 slots left), forked into 2 samples that share both.
    a = prompt[:8] + [40, 41, 42]
    b = list(range(50, 56))
    first, second, *_ = _steps(llm, [(a, three), (b, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=3))])
    assert first["blocks"] == {"total": total, "used": 5, "cached": 0, "free": total - 5}
    assert first["sharing"] == {"shared_blocks": 2, "references_saved": 2,
                                "bytes_saved": 2 * info.kv_bytes_per_block}
    assert first["fragmentation"]["allocated_slots"] == 5 * BLOCK
    assert first["fragmentation"]["unused_slots"] == 1 + 2  # B's partial block counted once
    assert first["fragmentation"]["internal"] == 3 / 20
    assert first["prefix_cache"] == {"queried_tokens": 10 + 11 + 6, "hit_tokens": 8, "hit_rate": 8 / 27}
    # One decode token each: A fills its third block; the first sample of B to write its
    # shared partial block copies it, so B holds 3 blocks, the first still shared.
    assert second["blocks"]["used"] == 3 + 3
    assert second["sharing"]["shared_blocks"] == 1 and second["sharing"]["references_saved"] == 1
    assert second["fragmentation"]["unused_slots"] == 0 + 1 + 1
    assert second["sequences"] == {"running": 3, "waiting": 0}


def _report(used: int, unused: int, saved: int, queried: int, hits: int, preemptions: int) -> dict:
    return {"blocks": {"total": 100, "used": used, "cached": 0, "free": 100 - used}, "usage": used / 100,
            "sharing": {"bytes_saved": saved}, "fragmentation": {"internal": unused / (4 * used) if used else 0.0},
            "prefix_cache": {"queried_tokens": queried, "hit_tokens": hits}, "preemptions": preemptions}


def test_a_run_summary_by_hand() -> None:
    reports = [_report(0, 0, 0, 50, 10, 1), _report(10, 4, 2048, 150, 40, 1), _report(30, 3, 1024, 250, 60, 3),
               _report(0, 0, 0, 250, 60, 3)]
    assert summarize_reports(reports) == {
        "samples": 4, "peak_blocks_used": 30, "blocks_total": 100, "peak_usage": 0.3,
        # the two samples with blocks in use: 4/40 and 3/120
        "mean_internal_fragmentation": (0.1 + 0.025) / 2, "peak_sharing_bytes_saved": 2048,
        "preemptions": 2, "prefix_cache_hit_rate": 50 / 200,
    }
