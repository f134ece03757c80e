"""Decoding with value-dependent control flow, batched by coroutines.

Three per-example decoders, each an ``async def`` that awaits the model's own
predictions to decide what to do next:

* greedy decoding of a GRU sequence-to-sequence model: each example stops at its
  own end token (``tok = int((await bg.value(logits)).argmax())``);
* beam search: each example keeps its own beam and finished hypotheses;
* a grammar-based tree decoder: generate an AST-like expression tree, choosing each
  production from the model's prediction among those the grammar allows there.

Each runs eagerly (one example at a time, the unbatched reference) and with
``bg.run_all`` (one batched step whenever every example waits), and the outputs are
compared. Run: ``python examples/decode.py`` (a few seconds); ``--help`` for sizes.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import batchgraph as bg
from batchgraph.cli import at_least

BOS, EOS = 0, 1

# expression grammar: symbol -> productions (name, child symbols)
GRAMMAR: dict[str, list[tuple[str, list[str]]]] = {
    "expr": [("num", []), ("var", []), ("neg", ["expr"]), ("binop", ["expr", "op", "expr"]),
             ("call", ["name", "expr"])],
    "op": [("+", []), ("-", []), ("*", [])],
    "name": [("sin", []), ("exp", []), ("abs", [])],
}
PRODUCTIONS = [(symbol, name, kids) for symbol, rules in GRAMMAR.items() for name, kids in rules]
RULES_OF = {s: [i for i, (sym, _, _) in enumerate(PRODUCTIONS) if sym == s] for s in GRAMMAR}
LEAF_RULES = {s: [i for i in RULES_OF[s] if not PRODUCTIONS[i][2]] for s in GRAMMAR}


class Seq2Seq(bg.BatchedModule):
    """GRU encoder-decoder; per-example methods, no batch dimension."""

    def __init__(self, vocab: int, embed: int, hidden: int) -> None:
        super().__init__()
        self.src_embed = nn.Embedding(vocab, embed)
        self.encoder = nn.GRUCell(embed, hidden)
        self.tgt_embed = nn.Embedding(vocab, embed)
        self.decoder = nn.GRUCell(embed, hidden)
        self.out = nn.Linear(hidden, vocab)
        self.hidden = hidden
        # production choice for the tree decoder shares the decoder state
        self.rule_embed = nn.Embedding(len(PRODUCTIONS), embed)
        self.rule_out = nn.Linear(hidden, len(PRODUCTIONS))

    def encode(self, src: list[int]) -> Any:
        h = bg.batched_value(torch.zeros(self.hidden))
        for tok in src:
            h = self.encoder(self.src_embed(bg.batched_value(tok)), h)
        return h

    def step(self, tok: int, h: Any) -> tuple[Any, Any]:
        h = self.decoder(self.tgt_embed(bg.batched_value(tok)), h)
        return self.out(h), h

    async def greedy(self, src: list[int], max_len: int) -> list[int]:
        h, tok, out = self.encode(src), BOS, []
        for _ in range(max_len):
            logits, h = self.step(tok, h)
            tok = int((await bg.value(logits)).argmax())  # the example decides here
            if tok == EOS:
                break
            out.append(tok)
        return out

    async def beam_search(self, src: list[int], width: int, max_len: int) -> list[int]:
        beams: list[tuple[float, list[int], Any]] = [(0.0, [BOS], self.encode(src))]
        finished: list[tuple[float, list[int]]] = []
        for _ in range(max_len):
            steps = [self.step(tokens[-1], h) for _, tokens, h in beams]
            logps = await bg.value([torch.log_softmax(logits, -1) for logits, _ in steps])
            candidates = []
            for (score, tokens, _), (_, h), lp in zip(beams, steps, logps):
                top = torch.topk(lp, width)
                for value, index in zip(top.values.tolist(), top.indices.tolist()):
                    candidates.append((score + value, [*tokens, index], h))
            candidates.sort(key=lambda c: -c[0])
            beams = []
            for score, tokens, h in candidates[:width]:
                if tokens[-1] == EOS:
                    finished.append((score / len(tokens), tokens[1:-1]))
                else:
                    beams.append((score, tokens, h))
            if not beams:
                break
        finished.extend((score / len(tokens), tokens[1:]) for score, tokens, _ in beams)
        return max(finished, key=lambda f: f[0])[1]

    async def tree(self, src: list[int], max_depth: int) -> Any:
        node, _ = await self._expand("expr", self.encode(src), 0, max_depth)
        return node

    async def _expand(self, symbol: str, h: Any, depth: int, max_depth: int) -> tuple[Any, Any]:
        allowed = RULES_OF[symbol] if depth < max_depth else LEAF_RULES[symbol]
        scores = (await bg.value(self.rule_out(h)))[allowed]
        rule = allowed[int(scores.argmax())]  # the grammar masks, the model chooses
        h = self.decoder(self.rule_embed(bg.batched_value(rule)), h)
        _, name, kids = PRODUCTIONS[rule]
        children = []
        for kid in kids:  # depth first, each child sees its left siblings' state
            child, h = await self._expand(kid, h, depth + 1, max_depth)
            children.append(child)
        return (name, *children) if children else name, h


def show_tree(node: Any) -> str:
    if isinstance(node, str):
        return node
    name, *kids = node
    if name == "binop":
        return f"({show_tree(kids[0])} {show_tree(kids[1])} {show_tree(kids[2])})"
    if name == "call":
        return f"{show_tree(kids[0])}({show_tree(kids[1])})"
    return f"-{show_tree(kids[0])}"


@torch.no_grad()
def calibrate_end_token(model: Seq2Seq, sources: list[list[int]], steps: int,
                        rate: float = 0.1) -> None:
    """Bias the end token so that an untrained model ends about ``rate`` of its steps.

    Random weights almost never predict the end token; the bias is the ``rate``
    quantile of how far it trails the best other token along eager greedy decodes.
    """
    gaps = []
    for src in sources:
        h, tok = model.encode(src), BOS
        for _ in range(steps):
            logits, h = model.step(tok, h)
            others = logits.clone()
            others[EOS] = -float("inf")
            tok = int(others.argmax())
            gaps.append(float(others[tok] - logits[EOS]))
    model.out.bias[EOS] += torch.tensor(gaps).quantile(rate)


def run_eagerly(coro: Coroutine[Any, Any, Any]) -> Any:
    """Outside a policy every await finishes at once: run the coroutine to its end."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("an eager example suspended")


@dataclass
class Timing:
    name: str
    eager: float
    batched: float
    two_groups: float


def compare(name: str, make: Any, sources: list[list[int]]) -> tuple[list[Any], Timing]:
    start = time.perf_counter()
    eager = [run_eagerly(make(src)) for src in sources]
    mid = time.perf_counter()
    batched = bg.run_all([make(src) for src in sources])
    end = time.perf_counter()
    two = bg.run_all([make(src) for src in sources], groups=2)
    last = time.perf_counter()
    if batched != eager or two != eager:
        raise AssertionError(f"{name}: batched outputs differ from the eager run")
    return batched, Timing(name, mid - start, end - mid, last - end)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=at_least(1), default=64)
    parser.add_argument("--vocab", type=at_least(3), default=40,
                        help="tokens, BOS and EOS included (default 40)")
    parser.add_argument("--hidden", type=at_least(1), default=64)
    parser.add_argument("--max-len", type=at_least(1), default=20)
    parser.add_argument("--beam", type=at_least(1), default=3)
    parser.add_argument("--depth", type=at_least(0), default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    model = Seq2Seq(args.vocab, args.hidden, args.hidden).eval()
    sources = [[rng.randrange(2, args.vocab) for _ in range(rng.randint(3, 12))]
               for _ in range(args.examples)]
    calibrate_end_token(model, sources[:8], args.max_len)
    bg.run_all([model.greedy(sources[0], 2)])  # warm the per-signature caches
    timings = []
    with torch.no_grad():
        greedy, t = compare("greedy", lambda s: model.greedy(s, args.max_len), sources)
        timings.append(t)
        beams, t = compare("beam", lambda s: model.beam_search(s, args.beam, args.max_len),
                           sources)
        timings.append(t)
        trees, t = compare("tree", lambda s: model.tree(s, args.depth), sources)
        timings.append(t)
    lengths = sorted(len(g) for g in greedy)
    print(f"{args.examples} examples; greedy lengths {lengths[0]}..{lengths[-1]} "
          f"(each stops at its own end token)")
    for i in range(min(3, args.examples)):  # the first few, however many there are
        print(f"  src {sources[i]}\n    greedy {greedy[i]}\n    beam   {beams[i]}\n"
              f"    tree   {show_tree(trees[i])}")
    print(f"\n{'decoder':8} {'eager s':>9} {'run_all s':>10} {'speed-up':>9} {'2 groups s':>11}")
    for t in timings:
        print(f"{t.name:8} {t.eager:9.3f} {t.batched:10.3f} {t.eager / t.batched:8.1f}x "
              f"{t.two_groups:11.3f}")
    print("batched outputs equal the eager ones (checked)")


if __name__ == "__main__":
    main()
