"""Train the course model (target ~11M or draft ~1.2M parameters) on the prepared plays.

    python -m layer3_model.training.data --out DATA                  # fetch + clean + split
    python -m layer3_model.training.tokenizer --data DATA      # DATA/tokenizer/
    python -m layer3_model.training.train --size target --data DATA --out OUT [--steps N ...]

The plays are tokenized once into DATA/tokens/{train,val}.npy (uint16: carry that folder
and DATA/tokenizer to the GPU machine; the text is not needed there). Each step samples
random windows of `seq` tokens; AdamW with linear warm-up and cosine decay, gradient
clipping, bf16 autocast on CUDA. Every `--eval-every` steps the validation loss (held-out
plays) is measured and, when it improves, OUT is rewritten as a Hugging Face directory:
config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json and README.md (the model card). OUT.ckpt.pt (beside OUT, so OUT
holds only what ships) resumes a run with --resume.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ..model import LlamaModel, causal_lm_loss
from .card import hardware_name, write_model_dir
from .course import SIZES, new_model
from .data import cache_dir
from .tokens import load_tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), required=True)
    ap.add_argument("--data", type=Path, default=cache_dir() / "prepared")
    ap.add_argument("--tokenizer", type=Path, default=None, help="default: DATA/tokenizer")
    ap.add_argument("--out", type=Path, required=True, help="the HF model directory to write")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512,
                    help="training window (also max_position_embeddings)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=None, help="default: 5%% of steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=None, help="default: 0.1 target, 0.0 draft")
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-batches", type=int, default=20)
    ap.add_argument("--ckpt-every", type=int, default=500)
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="stop (evaluate, save) after this long in this process")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (GPU)")
    ap.add_argument("--ckpt", type=Path, default=None,
                    help="training checkpoint (default OUT.ckpt.pt beside OUT, "
                         "so OUT stays committable)")
    ap.add_argument("--resume", action="store_true", help="continue from the checkpoint")
    ap.add_argument("--tokenize-only", action="store_true", help="write DATA/tokens/ and stop")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    args = ap.parse_args(argv)
    for name in ("steps", "batch", "seq", "eval_every", "eval_batches", "ckpt_every"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


def lr_at(step: int, total: int, warmup: int, lr: float, min_lr: float) -> float:
    """Linear warm-up to `lr` over `warmup` steps, then cosine decay to `min_lr` at `total`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def sample_batch(
    tokens: torch.Tensor, batch: int, seq: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs (batch, seq) and next-token targets (batch, seq), on tokens'
    device."""
    starts = torch.randint(
        0, tokens.numel() - seq - 1, (batch,), generator=gen, device=tokens.device
    )
    windows = tokens[starts[:, None] + torch.arange(seq + 1, device=tokens.device)]
    return windows[:, :-1], windows[:, 1:]


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokens: torch.Tensor, batch: int, seq: int, max_batches: int,
             amp: torch.autocast | None) -> float:
    """Mean next-token loss over the first max_batches*batch non-overlapping windows of `tokens`."""
    model.eval()
    n = min((tokens.numel() - 1) // seq, max_batches * batch)
    if n == 0:
        raise ValueError(f"validation set ({tokens.numel()} tokens) is "
                         f"shorter than one window of {seq}")
    total = 0.0
    for lo in range(0, n, batch):
        starts = torch.arange(lo, min(n, lo + batch), device=tokens.device) * seq
        w = tokens[starts[:, None] + torch.arange(seq + 1, device=tokens.device)]
        with amp or torch.autocast("cpu", enabled=False):
            logits = model(w[:, :-1])
        total += causal_lm_loss(logits, w[:, 1:]).item() * w[:, 1:].numel()
    model.train()
    return total / (n * seq)


def make_optimizer(
    model: LlamaModel, lr: float, weight_decay: float, fused: bool
) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms' gains)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def train(args: argparse.Namespace, console: Console | None = None) -> dict[str, object]:
    """Run training as `args` says; returns the run's statistics (also in OUT/README.md)."""
    console = console or Console()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(args.seed)
    tok_dir = args.tokenizer or args.data / "tokenizer"
    train_np, val_np, meta = load_tokens(args.data, tok_dir)
    if args.tokenize_only:
        console.print(f"{args.data / 'tokens'}: train {meta['train_tokens']:,} tokens "
                      f"({meta['train_plays']} plays), val {meta['val_tokens']:,} tokens "
                      f"({meta['val_plays']} plays)")
        return {"meta": meta}
    train_ids = torch.from_numpy(train_np.astype("int64")).to(device)
    val_ids = torch.from_numpy(val_np.astype("int64")).to(device)
    dropout = args.dropout if args.dropout is not None else (0.1 if args.size == "target" else 0.0)
    model = new_model(args.size, meta["vocab_size"], args.seq, dropout).to(device)
    cfg = model.config
    n_params = model.num_parameters()
    console.print(f"[bold]{args.size}[/]: {n_params:,} parameters ({n_params / 1e6:.2f}M; "
                  f"{n_params * 2 / 2**20:.1f} MiB in bf16), {cfg.num_hidden_layers} layers, dim "
                  f"{cfg.hidden_size}, {cfg.num_attention_heads} heads / "
                  f"{cfg.num_key_value_heads} kv heads; "
                  f"train {train_ids.numel():,} tokens, val "
                  f"{val_ids.numel():,} tokens; device {device}")
    opt = make_optimizer(model, args.lr, args.weight_decay, fused=device.type == "cuda")
    step, best, elapsed = 0, float("inf"), 0.0
    ckpt_path = Path(args.ckpt or Path(args.out).with_name(Path(args.out).name + ".ckpt.pt"))
    if args.resume:
        if not ckpt_path.is_file():
            raise FileNotFoundError(f"--resume: {ckpt_path} does not exist")
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        step, best, elapsed = ckpt["step"], ckpt["best_val"], ckpt["elapsed"]
    fwd = torch.compile(model) if args.compile else model
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
    gen = torch.Generator(device=device).manual_seed(args.seed + step)
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    stats: dict[str, object] = {
        "size": args.size,
        "params": n_params,
        "config": cfg,
        "args": vars(args),
        "dropout": dropout,
        "train_tokens": train_ids.numel(),
        "val_tokens": val_ids.numel(),
        "meta": meta,
        "hardware": hardware_name(device),
        "history": [],
        "precision": "bf16 autocast" if amp else "fp32",
    }
    best_state: dict[str, torch.Tensor] = {}

    def save_checkpoint() -> None:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                    "best_val": best, "elapsed": elapsed}, ckpt_path)

    def run_eval() -> None:
        nonlocal best, eval_time
        t_eval = time.perf_counter()
        val = evaluate(fwd, val_ids, args.batch, args.seq, args.eval_batches, amp)
        stats["history"].append((step, loss_avg, val))
        improved = val < best
        if improved:
            best = val
            best_state.update({k: v.detach().clone() for k, v in model.state_dict().items()})
            stats.update(
                best_val=val,
                best_step=step,
                elapsed=elapsed,
                tokens_seen=step * args.batch * args.seq,
            )
            write_model_dir(model, args.out, tok_dir, stats)
        console.print(f"step {step:6d}  train {loss_avg:.3f}  val {val:.3f} (ppl "
                      f"{math.exp(val):.1f})"
                      f"{'  saved' if improved else ''}  {elapsed:.0f}s")
        eval_time += time.perf_counter() - t_eval

    Path(args.out).mkdir(parents=True, exist_ok=True)
    loss_avg, t0, tokens_done = float("nan"), time.perf_counter() - elapsed, 0
    t_start, eval_time = time.perf_counter(), 0.0  # this process's start (t0 includes resumed time)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(f"training {args.size}", total=args.steps, completed=step, info="")
        model.train()
        while step < args.steps:
            lr = lr_at(step, args.steps, warmup, args.lr, args.lr * args.min_lr_ratio)
            for group in opt.param_groups:
                group["lr"] = lr
            x, y = sample_batch(train_ids, args.batch, args.seq, gen)
            with amp or torch.autocast("cpu", enabled=False):
                logits = fwd(x)
            loss = causal_lm_loss(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            step += 1
            tokens_done += x.numel()
            if step % 10 == 0 or step == args.steps:  # .item() syncs the GPU: not every step
                value = loss.item()
                loss_avg = value if math.isnan(loss_avg) else 0.9 * loss_avg + 0.1 * value
                elapsed = time.perf_counter() - t0
                tok_s = tokens_done / max(1e-9, time.perf_counter() - t_start - eval_time)
                info = f"loss {loss_avg:.3f} lr {lr:.2e} {tok_s:,.0f} tok/s"
                bar.update(task, completed=step, info=info)
                stats["tokens_per_s"] = tok_s
            if step % args.eval_every == 0 or step == args.steps:
                elapsed = time.perf_counter() - t0
                run_eval()
            if step % args.ckpt_every == 0:
                save_checkpoint()
            if (
                args.max_minutes is not None
                and time.perf_counter() - t_start > args.max_minutes * 60
            ):
                console.print(f"[yellow]--max-minutes {args.max_minutes} reached at step {step}[/]")
                if step % args.eval_every:
                    elapsed = time.perf_counter() - t0
                    run_eval()
                break
    elapsed = time.perf_counter() - t0
    save_checkpoint()
    stats.update(steps_done=step, total_time=elapsed)
    # the exported model is the best one seen; the card gets the final numbers + a sample
    if best_state:
        model.load_state_dict(best_state)
        write_model_dir(model, args.out, tok_dir, stats, sample=True)
    console.print(f"best val loss {best:.3f} (ppl {math.exp(best):.1f}) at step "
                  f"{stats.get('best_step')}; "
                  f"{elapsed:.0f}s on {stats['hardware']}; wrote {args.out}")
    return stats


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
