"""`kvserve train-drafter`: train Medusa heads or an EAGLE-1 head (train_eagle) for a model
by self-distillation.

The target scores the text (one forward pass a chunk through the engine's own model and
paged cache): its last hidden state at each position t and its greedy prediction at each
position. Head i learns, from the hidden state at t, the target's prediction at t + i + 1
(the token the target would produce i + 2 places ahead), so its top-1 agrees with what
greedy verification accepts. Each head starts as Medusa's do (a zero residual block, the
target's LM head) and its residual block is trained; `--train-lm-head` trains each head's
LM head copy too (Medusa-1's recipe: better heads, but a 49k-token head per draft position
costs most of the time and memory on a CPU). Held-out
chunks give each head's top-1 agreement with the target, the acceptance a chain of drafts
sees per position, printed beside a random head's. `--draft-vocab-size N` gives the heads an
LM head over the N tokens the target predicts most often in the training text (written as
`draft_vocab`): drafting and training then project onto N rows instead of the whole vocabulary.

    kvserve train-drafter --method medusa --model M --data text.jsonl --out heads/
    kvserve train-drafter --method eagle --model M --data text.jsonl --out eagle/

`--seed` (the engine's) seeds the held-out split, the order of the chunks and the init.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from kvserve.engine.engine_args import EngineArgs
from kvserve.llm import LLM
from kvserve.spec_decode.medusa import MedusaHeads


def read_texts(path: str) -> list[str]:
    """A .jsonl file's "text" fields, or a text file's paragraphs (blank-line separated)."""
    with open(path) as f:
        if path.endswith(".jsonl"):
            return [json.loads(line)["text"] for line in f if line.strip()]
        return [p.strip() for p in f.read().split("\n\n") if p.strip()]


@torch.inference_mode()
def score(llm: LLM, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(last hidden states [n, H], the target's greedy prediction at each position [n])."""
    runner = llm.engine.core.runner
    n = len(token_ids)
    positions = torch.arange(n)
    metadata = runner._metadata(positions, [0, n], [n], [list(range(-(-n // runner.block_size)))])
    hidden = runner.model(torch.tensor(token_ids), positions, runner.kv_caches, metadata)
    return hidden.float(), runner.model.compute_logits(hidden).argmax(dim=-1)


def split_chunks(llm: LLM, texts: list[str], chunk_tokens: int, min_tokens: int, held_out: float,
                 seed: int) -> tuple[list[list[int]], int]:
    """The texts' token ids in chunks of up to `chunk_tokens` (shorter than `min_tokens`:
    dropped), shuffled, and how many of the first are held out."""
    tokenizer = llm.get_tokenizer()
    chunks = []
    for text in texts:
        ids = tokenizer(text).input_ids
        chunks += [ids[i : i + chunk_tokens] for i in range(0, len(ids), chunk_tokens)
                   if len(ids[i : i + chunk_tokens]) >= min_tokens]
    if len(chunks) < 2:
        raise ValueError(f"--data has {len(chunks)} chunk(s) of at least {min_tokens} tokens; allowed: at least 2 "
                         "(one to train on, one held out)")
    random.Random(seed).shuffle(chunks)
    return chunks, max(1, int(len(chunks) * held_out))


def head_targets(predictions: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[num_heads, n] the label of head i at position t: the target's prediction at t + i + 1
    (-100, ignored, past the chunk's end)."""
    n = predictions.shape[0]
    labels = torch.full((num_heads, n), -100, dtype=torch.long)
    for i in range(num_heads):
        labels[i, : max(0, n - i - 1)] = predictions[i + 1 :]
    return labels


def most_predicted_tokens(data: list[tuple[torch.Tensor, torch.Tensor]], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` target tokens most often among the labels (ties and unseen tokens: lower ids,
    which a BPE vocabulary gives its more frequent merges), sorted."""
    counts = torch.zeros(vocab_size)
    for _, labels in data:
        valid = labels[labels != -100]
        counts += torch.bincount(valid, minlength=vocab_size)
    # A tiny decreasing term orders equal counts by id.
    order = (counts - torch.arange(vocab_size) / vocab_size).argsort(descending=True)
    return order[:size].sort().values


def to_draft_labels(labels: torch.Tensor, draft_vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """Labels as LM head rows: the target token's row in the draft vocabulary, -100 (ignored)
    for a token outside it."""
    if draft_vocab is None:
        return labels
    row_of = torch.full((vocab_size + 1,), -100, dtype=torch.long)
    row_of[draft_vocab] = torch.arange(len(draft_vocab))
    return row_of[labels.where(labels != -100, vocab_size)]


def agreement(heads: MedusaHeads, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Per head, the fraction of positions where its top-1 is the target's prediction."""
    hits = torch.zeros(heads.num_heads)
    counts = torch.zeros(heads.num_heads)
    with torch.no_grad():
        for hidden, labels in data:
            predicted = heads(hidden).argmax(dim=-1)  # [heads, n]
            if heads.draft_vocab is not None:
                predicted = heads.draft_vocab[predicted]
            valid = labels != -100
            hits += ((predicted == labels) & valid).sum(dim=1)
            counts += valid.sum(dim=1)
    return (hits / counts.clamp_min(1)).tolist()


def initial_heads(llm: LLM, num_heads: int, train_lm_head: bool, draft_vocab: torch.Tensor | None) -> MedusaHeads:
    model, config = llm.engine.core.runner.model, llm.engine.model_config
    lm_head = model.model.embed_tokens.weight if config.tie_word_embeddings else model.lm_head.weight
    if draft_vocab is not None:
        lm_head = lm_head[draft_vocab]
    heads = MedusaHeads(config.hidden_size, lm_head.shape[0], num_heads, num_layers=1, draft_vocab=draft_vocab)
    with torch.no_grad():
        for blocks, head in zip(heads.blocks, heads.lm_heads):
            blocks[0].weight.zero_()
            blocks[0].bias.zero_()
            head.weight.copy_(lm_head.float())
            head.weight.requires_grad_(train_lm_head)
    return heads


def train(llm: LLM, texts: list[str], num_heads: int, chunk_tokens: int, epochs: int, lr: float,
          held_out: float, seed: int, train_lm_head: bool = False,
          draft_vocab_size: int = 0) -> tuple[MedusaHeads, list[float], list[float]]:
    """(trained heads, their held-out agreement per head, a random head's)."""
    chunks, num_held_out = split_chunks(llm, texts, chunk_tokens, num_heads + 2, held_out, seed)
    scored = []
    for ids in tqdm(chunks, desc="scoring with the target", unit="chunk"):
        hidden, predictions = score(llm, ids)
        # A copy outside inference mode: autograd may save it for the backward pass.
        scored.append((hidden.clone(), head_targets(predictions, num_heads)))
    evaluation, training = scored[:num_held_out], scored[num_held_out:]
    vocab_size = llm.engine.model_config.vocab_size
    draft_vocab = (most_predicted_tokens(training, vocab_size, draft_vocab_size)
                   if 0 < draft_vocab_size < vocab_size else None)
    training = [(hidden, to_draft_labels(labels, draft_vocab, vocab_size)) for hidden, labels in training]
    torch.manual_seed(seed)
    heads = initial_heads(llm, num_heads, train_lm_head, draft_vocab)
    optimizer = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=lr)
    with tqdm(total=epochs * len(training), desc="training Medusa heads", unit="chunk") as progress:
        for _ in range(epochs):
            random.Random(seed).shuffle(training)
            for hidden, labels in training:
                logits = heads(hidden)  # [heads, n, V]
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                progress.set_postfix(loss=f"{loss.item():.3f}")
                progress.update()
    baseline = MedusaHeads(heads.hidden_size, heads.vocab_size, num_heads, 1, draft_vocab)
    return heads, agreement(heads, evaluation), agreement(baseline, evaluation)


def save_medusa_heads(heads: MedusaHeads, out: str) -> None:
    """The Medusa repository's layout, which `speculative_config={"method": "medusa"}` loads."""
    os.makedirs(out, exist_ok=True)
    state = {}
    for i, (blocks, head) in enumerate(zip(heads.blocks, heads.lm_heads)):
        state[f"{i}.0.linear.weight"] = blocks[0].weight.detach().contiguous()
        state[f"{i}.0.linear.bias"] = blocks[0].bias.detach().contiguous()
        state[f"{i}.1.weight"] = head.weight.detach().contiguous()
    if heads.draft_vocab is not None:
        state["draft_vocab"] = heads.draft_vocab.contiguous()
    save_file(state, os.path.join(out, "medusa_lm_head.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"medusa_num_heads": heads.num_heads, "medusa_num_layers": 1}, f, indent=2)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("drafter training")
    group.add_argument("--method", choices=["medusa", "eagle"], required=True,
                       help="The draft method to train: Medusa heads, or an EAGLE-1 head (one decoder layer "
                            "over the target's features, the EAGLE repository's layout).")
    group.add_argument("--data", required=True,
                       help="Training text: a .jsonl file with a \"text\" field a line, or a text file "
                            "(paragraphs separated by blank lines).")
    group.add_argument("--out", required=True,
                       help="Directory to write the drafter to (the Medusa or the EAGLE repository's layout).")
    group.add_argument("--num-heads", type=int, default=3, help="Medusa heads: the deepest draft position.")
    group.add_argument("--num-speculative-tokens", type=int, default=3,
                       help="EAGLE: the draft positions whose chained held-out acceptance is printed.")
    group.add_argument("--cls-weight", type=float, default=0.1,
                       help="EAGLE: weight of the cross entropy of the target's LM head over the estimated "
                            "feature (against the target's greedy token) beside the feature regression "
                            "(SmoothL1, weight 1); EAGLE's is 0.1.")
    group.add_argument("--feature-noise", type=float, default=0.0,
                       help="EAGLE: width a of the uniform noise U(-a/2, a/2) added to the target's features the "
                            "head reads in training (never in serving), so it tolerates its own estimates' errors.")
    group.add_argument("--unroll-steps", type=int, default=1,
                       help="EAGLE: draft steps trained per pair: step k > 1 reads step k - 1's estimate, as "
                            "drafting does (EAGLE-3's training-time test); its loss is weighted 0.8 ** (k - 1).")
    group.add_argument("--chunk-tokens", type=int, default=256, help="Tokens the target scores per chunk.")
    group.add_argument("--epochs", type=int, default=3, help="Passes over the training chunks.")
    group.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate.")
    group.add_argument("--train-lm-head", action="store_true",
                       help="Medusa: train each head's copy of the LM head too (better heads, much slower on a CPU).")
    group.add_argument("--draft-vocab-size", type=int, default=0,
                       help="Give the heads (Medusa) or the head (EAGLE: the target's LM head's rows, saved as d2t) an "
                            "LM head over only the N tokens the model predicts most often in the training text (0: the "
                            "whole vocabulary). Drafting then projects onto N rows, the lever on a small model whose "
                            "LM head is a large share of a step.")
    group.add_argument("--held-out", type=float, default=0.1,
                       help="Fraction of chunks held out to measure acceptance.")


def run_from_args(args: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    if llm.get_tokenizer() is None:
        raise ValueError("train-drafter needs the model's tokenizer to read --data")
    texts = read_texts(args.data)
    if args.method == "eagle":
        trained, random_head = _train_eagle(llm, texts, args, engine_args.seed)
    else:
        heads, trained, random_head = train(llm, texts, args.num_heads, args.chunk_tokens, args.epochs, args.lr,
                                            args.held_out, engine_args.seed, args.train_lm_head,
                                            args.draft_vocab_size)
        save_medusa_heads(heads, args.out)
        print(f"wrote {args.num_heads} Medusa heads to {args.out}")
    print("held-out acceptance (top-1 agreement with the target) per draft position: " + _percentages(trained)
          + "; a random head: " + _percentages(random_head))
    return 0


def _percentages(fractions: list[float]) -> str:
    return ", ".join("n/a" if math.isnan(a) else f"{a:.1%}" for a in fractions)


def _train_eagle(llm: LLM, texts: list[str], args: argparse.Namespace, seed: int) -> tuple[list[float], list[float]]:
    from kvserve.spec_decode.train_eagle import save_eagle_head, train_eagle

    chunks, num_held_out = split_chunks(llm, texts, args.chunk_tokens, 3, args.held_out, seed)
    scored = []
    for ids in tqdm(chunks, desc="scoring with the target", unit="chunk"):
        hidden, predictions = score(llm, ids)
        # Copies outside inference mode: autograd may save them for the backward pass.
        scored.append((torch.tensor(ids), hidden.clone(), predictions.clone()))
    head, draft_vocab, trained, random_head = train_eagle(
        llm, scored, num_held_out, args.num_speculative_tokens, args.epochs, args.lr, args.cls_weight, seed,
        args.feature_noise, args.unroll_steps, args.draft_vocab_size)
    save_eagle_head(head, llm, args.out, draft_vocab)
    print(f"wrote an EAGLE head to {args.out}")
    return trained, random_head
