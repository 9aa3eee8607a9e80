"""The training check (GPU): a small GPT-style model learns a fixed synthetic task with
``attention`` (forward K6, backward K9 or K10, through autograd) as with SDPA, from the same seed.

    python -m harness.training --out results/training-h100.json    # both loss curves, per step
    pytest -m gpu tests/test_training.py                           # the same run, asserted

The task needs attention: each sequence repeats a random 16-token motif, so from the second
repeat on a token is predictable only by looking back 16 positions; a model that does not look
back stays at ln(64) = 4.16 nats.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

VOCAB, SEQ, WIDTH, HEADS, LAYERS, STEPS = 64, 128, 256, 2, 4, 300  # head dim 128
NO_LOOK_BACK = math.log(VOCAB)  # the loss of a model that predicts each token from nothing before it


class Block(torch.nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.attend = attend
        self.norm1, self.norm2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
        self.qkv, self.proj = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
                                       torch.nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, HEADS, WIDTH // HEADS).transpose(1, 2).to(torch.bfloat16)
                   for t in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        o = self.attend(q, k, v)
        x = x + self.proj(o.float().transpose(1, 2).reshape(b, n, WIDTH))
        return x + self.mlp(self.norm2(x))


class TinyGPT(torch.nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.pos = torch.nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(attend) for _ in range(LAYERS))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batches(steps: int, batch: int = 16):
    gen = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(steps):
        motif = torch.randint(0, VOCAB, (batch, 16), device="cuda", generator=gen)
        yield motif.repeat(1, SEQ // 16 + 1)[:, :SEQ + 1]


def attend_with(name: str):
    """The attention a run uses: "sdpa", or a backward stage ("k9", "k10", "k10_fa3": the default):
    our forward K6 and that stage's backward."""
    if name == "sdpa":
        return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    from harness import attention

    return lambda q, k, v: attention("k6", q, k, v, causal=True, backward=name)


def train(name: str, steps: int = STEPS) -> list:
    """The loss of every step, from seed 0, AdamW at 1e-3."""
    torch.manual_seed(0)
    model = TinyGPT(attend_with(name)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for tokens in batches(steps):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def tail(losses: list, n: int = 20) -> float:
    return sum(losses[-n:]) / n


def main(argv=None) -> int:
    from harness import results

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", default=["sdpa", "k9", "k10", "k10_fa3"],
                    choices=["sdpa", "k9", "k10", "k10_fa3"])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    out = results.open_result_file(args.out, results.command_line("-m harness.training", argv))
    for name in args.runs:
        losses = train(name)
        row = dict(run=name, steps=len(losses), losses=[round(x, 5) for x in losses], tail=tail(losses))
        if out:
            out.append(row)
        print(f"{name:<6} first {losses[0]:.3f}  last-20 mean {row['tail']:.3f}", flush=True)
    if out:
        print(f"wrote {out.close()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
