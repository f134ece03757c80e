"""BiLSTM tagger throughput: eager per-sentence vs hand-batched vs batchgraph.

DyNet's autobatching paper measured a BiLSTM part-of-speech tagger on the CPU at about
9x its own unbatched run (16.8 -> 156 sentences/s, batch 64). This is that workload in
PyTorch: per sentence, an embedding per word, a forward and a backward ``LSTMCell``
chain over the words, and an MLP on each word's ``[forward; backward]`` state giving
tag scores; the loss is the summed cross-entropy of every word's tag. Variants, on the
same weights (one ``state_dict`` copied into each), batches, loss and optimizer (SGD):

- ``eager``: ``Tagger.logits`` per sentence, no policy: the unbatched baseline;
- ``hand``: the same modules batched by hand: sentences sorted by length, one cell
  call per position for the sentences still that long (each direction), one embedding
  and one MLP call for every word of the batch: the ceiling;
- ``agenda`` / ``depth``: the per-sentence code under ``bg.BatchingPolicy`` with the
  agenda or the by-depth scheduler.

A second model (``--models layers``; both run by default), ``SeqTagger``, is written
per sentence at the sequence level: one ``nn.Embedding`` call on the sentence's ``(T,)``
word ids, one ``nn.LSTM(bidirectional=True)`` call on its ``(T, E)`` embeddings (batched
by the built-in ``PackedSequenceKey`` whatever the lengths) and one call of the tag MLP
on its ``(T, 2H)`` outputs. Its variants, compared among themselves (``x eager`` and
``x hand`` against ``seq-eager`` and ``seq-hand``):

- ``seq-eager``: ``SeqTagger.logits`` per sentence, no policy;
- ``seq-hand``: one embedding call on every word, one packed LSTM call, one MLP call;
- ``seq-default``: the per-sentence code under the default keys, where the embedding
  and the MLP batch only among sentences of equal length (a launch per length);
- ``seq-rows``: the same, with the embedding and the MLP marked row-wise
  (``batch_key = bg.RowwiseKey`` on the two instances): one launch each.

Sentences are synthetic with lengths like the Penn Treebank's (mean about 24 words,
3 to 60), Zipf-distributed word ids and 45 tags. Sizes (ours, not DyNet's exact
configuration): embedding 128, LSTM hidden 128 per direction, MLP hidden 64. One
intra-op thread. Before timing, every variant's loss and gradients on one batch must
equal eager's (relative 1e-5). Variants alternate within rounds (the host is shared
and noisy); medians over rounds are reported, for inference (no grad) and training
(forward, loss, backward, SGD step).

Run: ``python benchmarks/tagger.py`` (a few minutes) or ``--quick``. Prints a table
and writes ``benchmarks/results/tagger.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_sequence, pad_packed_sequence

import batchgraph as bg

VARIANTS = ("eager", "hand", "agenda", "depth")
SEQ_VARIANTS = ("seq-eager", "seq-hand", "seq-default", "seq-rows")
# Per model: its variants, and the names its speeds are compared with.
FAMILIES = {"cells": (VARIANTS, "eager", "hand"),
            "layers": (SEQ_VARIANTS, "seq-eager", "seq-hand")}
MODES = ("inference", "training")
RESULTS = Path(__file__).resolve().parent / "results" / "tagger.json"
TAGS = 45


@dataclass(frozen=True)
class Sentence:
    words: list[int]
    tags: list[int]


def sentences(count: int, vocab: int, seed: int, max_len: int = 60) -> list[Sentence]:
    """Synthetic tagged sentences: Penn-Treebank-like lengths, Zipf word ids, and a
    tag that depends on the word (so the task is learnable)."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) for rank in range(vocab)]
    out = []
    for _ in range(count):
        length = max(3, min(max_len, round(rng.gammavariate(4.0, 6.0))))
        words = rng.choices(range(vocab), weights, k=length)
        out.append(Sentence(words, [(w * 7 + rng.randrange(2)) % TAGS for w in words]))
    return out


class _TagLayers(nn.Module):
    """The tag MLP's layers: ``2h`` BiLSTM features -> ``mlp`` (tanh) -> tag scores."""

    batch_key = bg.StackKey  # written for a leading batch dimension

    def __init__(self, hidden: int, mlp: int, tags: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(2 * hidden, mlp)
        self.out = nn.Linear(mlp, tags)


class TagMLP(_TagLayers):
    """Tag scores from a word's forward and backward states (``(2h,)`` or ``(B, 2h)``)."""

    def forward(self, fwd: torch.Tensor, bwd: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(torch.tanh(self.hidden(torch.cat([fwd, bwd], dim=-1))))
        return out


class Tagger(bg.BatchedModule):
    """A BiLSTM tagger written for one sentence (see the module docstring)."""

    def __init__(self, vocab: int, embed: int, hidden: int, mlp: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.fwd = nn.LSTMCell(embed, hidden)
        self.bwd = nn.LSTMCell(embed, hidden)
        self.mlp = TagMLP(hidden, mlp, TAGS)

    def logits(self, words: Sequence[int]) -> list[Any]:
        """Per word, its ``(tags,)`` scores (handles while recording)."""
        xs = [self.embed(bg.batched_value(w)) for w in words]
        return [self.mlp(f, b) for f, b in zip(_run(self.fwd, xs),
                                                  reversed(_run(self.bwd, xs[::-1])))]


class TagHead(_TagLayers):
    """Tag scores from ``(..., 2h)`` BiLSTM outputs: a sentence's ``(T, 2h)`` at once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(torch.tanh(self.hidden(x)))
        return out


class SeqTagger(bg.BatchedModule):
    """The BiLSTM tagger written for one sentence with sequence-level calls."""

    def __init__(self, vocab: int, embed: int, hidden: int, mlp: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, bidirectional=True)
        self.mlp = TagHead(hidden, mlp, TAGS)

    def logits(self, words: Sequence[int]) -> Any:
        """The sentence's ``(T, tags)`` scores (a handle while recording)."""
        out, _ = self.lstm(self.embed(torch.tensor(words)))
        return self.mlp(out)


def seq_hand_logits(model: SeqTagger, batch: Sequence[Sentence]) -> torch.Tensor:
    """``(words of the batch, tags)`` scores of ``SeqTagger``, batched by hand."""
    lengths = [len(s.words) for s in batch]
    x = model.embed(torch.tensor([w for s in batch for w in s.words]))
    out, _ = model.lstm(pack_sequence(list(x.split(lengths)), enforce_sorted=False))
    padded, _ = pad_packed_sequence(out, batch_first=True)
    keep = torch.arange(padded.shape[1]) < torch.tensor(lengths).unsqueeze(1)
    scores: torch.Tensor = model.mlp(padded[keep])
    return scores


def _run(cell: nn.Module, xs: Sequence[Any]) -> list[Any]:
    """The ``h`` of ``cell`` over ``xs`` in order, from a zero state."""
    state = cell(xs[0])
    hs = [state[0]]
    for x in xs[1:]:
        state = cell(x, state)
        hs.append(state[0])
    return hs


def hand_logits(model: Tagger, batch: Sequence[Sentence]) -> torch.Tensor:
    """``(words of the batch, tags)`` scores, sentence by sentence and word by word in
    order, with one cell call per position and direction (the ceiling)."""
    order = sorted(range(len(batch)), key=lambda i: -len(batch[i].words))
    lengths = [len(batch[i].words) for i in order]
    longest = lengths[0]
    padded = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, i in enumerate(order):
        padded[row, : lengths[row]] = torch.tensor(batch[i].words)
    x = model.embed(padded)  # (B, T, E), sorted longest first
    alive = [sum(n > t for n in lengths) for t in range(longest)]  # rows still that long
    fwd = _hand_direction(model.fwd, x, alive, range(longest))
    # Backward: row r's word t is its (len_r - 1 - t)-th from the end; running each
    # sentence reversed keeps "the rows still that long" a prefix of the sorted batch.
    rev_idx = torch.tensor([[max(n - 1 - t, 0) for t in range(longest)] for n in lengths])
    x_rev = x.gather(1, rev_idx.unsqueeze(-1).expand_as(x))
    bwd_rev = _hand_direction(model.bwd, x_rev, alive, range(longest))
    bwd = bwd_rev.gather(1, rev_idx.unsqueeze(-1).expand_as(bwd_rev))  # back to word order
    # Every real word, in the input's sentence order.
    rows = torch.tensor([order.index(i) for i in range(len(batch))])
    mask = torch.arange(longest) < torch.tensor(lengths).unsqueeze(1)
    keep = mask[rows]
    scores: torch.Tensor = model.mlp(fwd[rows][keep], bwd[rows][keep])
    return scores


def _hand_direction(cell: nn.LSTMCell, x: torch.Tensor, alive: list[int],
                    steps: range) -> torch.Tensor:
    """``h`` at every position (zeros past a row's length) of ``cell`` over ``x``."""
    hs = []
    state: tuple[torch.Tensor, torch.Tensor] | None = None
    for t in steps:
        n = alive[t]
        state = cell(x[:n, t]) if state is None else cell(x[:n, t], (state[0][:n], state[1][:n]))
        hs.append(F.pad(state[0], (0, 0, 0, x.shape[0] - n)))
    return torch.stack(hs, dim=1)


@dataclass
class Variant:
    name: str
    model: Any  # Tagger, or SeqTagger for the seq- variants
    optimizer: torch.optim.Optimizer
    last: bg.ScheduleStats | None = None  # the last batch's (its lower bound is lazy)

    def logits(self, batch: Sequence[Sentence]) -> torch.Tensor:
        if self.name.startswith("seq-"):
            return self._seq_logits(batch)
        if self.name == "eager":
            return torch.stack([s for sent in batch for s in self.model.logits(sent.words)])
        if self.name == "hand":
            return hand_logits(self.model, batch)
        with bg.BatchingPolicy(scheduler=self.name) as policy:
            handles = [h for sent in batch for h in self.model.logits(sent.words)]
        out = torch.stack(bg.compute(handles))
        self.last = policy.stats  # read after timing: the lower bound is worked out then
        return out

    def _seq_logits(self, batch: Sequence[Sentence]) -> torch.Tensor:
        if self.name == "seq-eager":
            return torch.cat([self.model.logits(sent.words) for sent in batch])
        if self.name == "seq-hand":
            return seq_hand_logits(self.model, batch)
        with bg.BatchingPolicy() as policy:
            handles = [self.model.logits(sent.words) for sent in batch]
        out = torch.cat(bg.compute(handles))
        self.last = policy.stats
        return out

    def loss(self, batch: Sequence[Sentence]) -> torch.Tensor:
        tags = torch.tensor([t for sent in batch for t in sent.tags])
        return F.cross_entropy(self.logits(batch), tags, reduction="sum")

    def run(self, batch: Sequence[Sentence], mode: str) -> None:
        if mode == "inference":
            with torch.no_grad():
                self.logits(batch)
            return
        loss = self.loss(batch)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()


def make_variants(vocab: int, embed: int, hidden: int, mlp: int, names: Sequence[str],
                  lr: float = 0.01) -> list[Variant]:
    kind = SeqTagger if names[0].startswith("seq-") else Tagger
    torch.manual_seed(0)
    state = kind(vocab, embed, hidden, mlp).state_dict()
    variants = []
    for name in names:
        model = kind(vocab, embed, hidden, mlp)
        model.load_state_dict(state)
        if name == "seq-rows":
            # These two instances treat rows independently: all the sentences' words
            # run as one call (an instance's batch_key comes before its class's).
            model.embed.batch_key = bg.RowwiseKey
            model.mlp.batch_key = bg.RowwiseKey
        variants.append(Variant(name, model, torch.optim.SGD(model.parameters(), lr=lr)))
    return variants


def check_equal(variants: list[Variant], batch: Sequence[Sentence], tol: float = 1e-5) -> float:
    """Every variant's loss and gradients on ``batch`` equal eager's to ``tol``
    (relative); the worst relative difference."""
    def loss_and_grads(v: Variant) -> tuple[float, list[torch.Tensor]]:
        v.model.zero_grad()
        loss = v.loss(batch)
        loss.backward()
        grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                 for p in v.model.parameters()]
        v.model.zero_grad()
        return float(loss.detach()), grads

    ref_loss, ref_grads = loss_and_grads(variants[0])
    worst = 0.0
    for v in variants[1:]:
        loss, grads = loss_and_grads(v)
        errs = [abs(loss - ref_loss) / max(1.0, abs(ref_loss))]
        errs += [float((g - r).abs().max()) / max(1.0, float(r.abs().max()))
                 for g, r in zip(grads, ref_grads, strict=True)]
        if max(errs) > tol:
            raise SystemExit(f"{v.name} differs from eager before timing: relative "
                             f"difference {max(errs):.2e} > {tol:.0e}")
        worst = max(worst, *errs)
    return worst


def measure(variants: list[Variant], batches: list[list[Sentence]], mode: str,
            rounds: int) -> dict[str, float]:
    """Median sentences/s per variant over ``rounds`` (variants alternate in a round)."""
    count = sum(len(b) for b in batches)
    speeds: dict[str, list[float]] = {v.name: [] for v in variants}
    for v in variants:  # warm-up: first calls pay one-off costs (shape inference)
        v.run(batches[0][:8], mode)
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for v in order:
            start = time.perf_counter()
            for batch in batches:
                v.run(batch, mode)
            speeds[v.name].append(count / (time.perf_counter() - start))
    return {name: statistics.median(s) for name, s in speeds.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="BiLSTM tagger throughput")
    parser.add_argument("--quick", action="store_true", help="smaller run")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--batches", type=int, default=2, help="batches per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=10000)
    parser.add_argument("--embed", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--mlp", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=60)
    parser.add_argument("--models", nargs="+", choices=tuple(FAMILIES), default=list(FAMILIES),
                        help="cells: LSTMCell chains, word by word; layers: SeqTagger")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sizes = args.batch_sizes or ([64] if args.quick else [16, 64, 256])
    rounds = 2 if args.quick else args.rounds
    print(f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus; "
          f"torch {torch.__version__}; intra-op threads {torch.get_num_threads()}; "
          f"embed {args.embed} hidden {args.hidden} mlp {args.mlp} vocab {args.vocab}; "
          f"medians of {rounds} rounds")
    print(f"{'mode':10} {'batch':>5} {'variant':11} {'sent/s':>9} {'x eager':>8} {'x hand':>7} "
          f"{'launches':>9} {'bound':>6}")
    rows: list[dict[str, Any]] = []
    worst = 0.0
    for size in sizes:
        pool = sentences(size * args.batches, args.vocab, seed=size, max_len=args.max_len)
        batches = [pool[i: i + size] for i in range(0, len(pool), size)]
        for family in args.models:
            names, eager, hand = FAMILIES[family]
            variants = make_variants(args.vocab, args.embed, args.hidden, args.mlp, names)
            worst = max(worst, check_equal(variants, batches[0]))
            for mode in MODES:
                speeds = measure(variants, batches, mode, rounds)
                for v in variants:
                    launches = v.last.launches if v.last is not None else None
                    bound = v.last.lower_bound if v.last is not None else None
                    row = {"mode": mode, "batch": size, "variant": v.name,
                           "sentences_per_s": speeds[v.name],
                           "vs_eager": speeds[v.name] / speeds[eager],
                           "vs_hand": speeds[v.name] / speeds[hand],
                           "launches": launches, "lower_bound": bound,
                           "mean_words": statistics.mean(len(s.words) for s in pool)}
                    rows.append(row)
                    print(f"{mode:10} {size:5} {v.name:11} {row['sentences_per_s']:9.1f} "
                          f"{row['vs_eager']:7.1f}x {row['vs_hand']:6.2f}x "
                          f"{launches or '':>9} {bound or '':>6}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "threads": 1},
        "sizes": {"vocab": args.vocab, "embed": args.embed, "hidden": args.hidden,
                  "mlp": args.mlp, "tags": TAGS, "max_len": args.max_len},
        "rounds": rounds, "max_relative_diff": worst, "rows": rows}, indent=2))
    print(f"(launches and bound: the last batch's; losses and gradients equal eager's to "
          f"{worst:.1e} relative)\nwrote {out}")


if __name__ == "__main__":
    main()
