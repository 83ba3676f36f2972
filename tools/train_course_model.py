"""Train the course models: a byte-level BPE tokenizer and two Llama-style models on Python's own source.

Every machine with Python has the corpus offline: the standard library's .py files. Files are split
into train and validation by a hash of their path, so the split is the same everywhere. The record of
each run (steps, tokens, wall time, validation bits per byte, corpus) is written beside the weights.

    python tools/train_course_model.py tokenizer                     # -> nanoserve/course_models/tokenizer.json
    python tools/train_course_model.py model --size draft --steps 1500
    python tools/train_course_model.py model --size base --steps 2000
    python tools/train_course_model.py smoke --out /tmp/x            # a few steps of a tiny model (tests)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from nanoserve.course.corpus import corpus_files, read  # noqa: E402  (the split, shared with chapter 07)
from nanoserve.models import CausalLM, ModelConfig  # noqa: E402

OUT = REPO / "nanoserve" / "course_models"
CACHE = REPO / "tools" / ".train_cache"
EOT = "<|endoftext|>"
VOCAB_SIZE = 4096

SIZES = {  # Llama architecture, tied embeddings; the draft is ~6x smaller for speculative decoding
    "base": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=8,
                 num_key_value_heads=4, lr=2e-3),
    "draft": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, lr=3e-3),
    "smoke": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, lr=3e-3),
}


def train_tokenizer(files: list[Path], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((read(f) for f in files), trainer=trainer)
    return tok


def token_stream(tok: Tokenizer, files: list[Path]) -> tuple[np.ndarray, int]:
    """All files as one stream of token ids, each followed by <|endoftext|>; and the corpus size in bytes."""
    eot = tok.token_to_id(EOT)
    texts = [read(f) for f in files]
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.array(ids, dtype=np.uint16), sum(len(t.encode("utf-8")) for t in texts)


def hf_config(size: str, vocab_size: int, eot: int) -> dict:
    s = {k: v for k, v in SIZES[size].items() if k != "lr"}
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab_size,
                max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                hidden_act="silu", attention_bias=False, mlp_bias=False, bos_token_id=eot, eos_token_id=eot,
                torch_dtype="float32", **s)


@torch.no_grad()
def evaluate(model, data: np.ndarray, seq_len: int, batches: int = 8, batch_size: int = 16) -> float:
    """Mean next-token loss (nats/token) over fixed, evenly spaced windows of `data`."""
    model.eval()
    starts = np.linspace(0, len(data) - seq_len - 2, batches * batch_size).astype(np.int64)
    total = 0.0
    for b in range(batches):
        x = torch.stack([torch.from_numpy(data[s:s + seq_len + 1].astype(np.int64)) for s in starts[b::batches]])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).item()
    model.train()
    return total / batches


def train_model(size: str, steps: int, out: Path, tok_file: Path, seq_len: int = 256, batch_size: int = 32,
                seed: int = 0, threads: int | None = None, file_limit: int | None = None) -> dict:
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    tok = Tokenizer.from_file(str(tok_file))
    train_files, val_files = corpus_files(file_limit)
    CACHE.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha1((tok.to_str() + str(file_limit)).encode()).hexdigest()[:12]
    cache = CACHE / f"tokens-{key}.npz"
    if cache.exists():
        z = np.load(cache)
        train, val, val_bytes = z["train"], z["val"], int(z["val_bytes"])
    else:
        train, _ = token_stream(tok, train_files)
        val, val_bytes = token_stream(tok, val_files)
        np.savez(cache, train=train, val=val, val_bytes=val_bytes)
    eot = tok.token_to_id(EOT)
    cfg_dict = hf_config(size, tok.get_vocab_size(), eot)
    model = CausalLM(ModelConfig.from_dict(cfg_dict))
    for name, p in model.named_parameters():  # small normal init, residual outputs scaled down by depth
        if p.dim() == 2:
            std = 0.02 / math.sqrt(2 * cfg_dict["num_hidden_layers"]) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            torch.nn.init.normal_(p, std=std)
    lr = SIZES[size]["lr"]
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)

    def lr_at(step):  # linear warm-up, cosine decay to 10%
        if step < warmup:
            return lr * (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    log = []
    t0 = time.time()
    model.train()
    for step in range(steps):
        starts = rng.integers(0, len(train) - seq_len - 1, size=batch_size)
        x = torch.from_numpy(np.stack([train[s:s + seq_len + 1] for s in starts]).astype(np.int64))
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 matmuls (AMX/AVX-512 where present), fp32 weights
            logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            elapsed = time.time() - t0
            log.append(dict(step=step, loss=round(loss.item(), 4), elapsed_s=round(elapsed, 1)))
            print(f"[{size}] step {step}/{steps} loss {loss.item():.3f} lr {lr_at(step):.2e} {elapsed:.0f}s", flush=True)
    wall = time.time() - t0
    val_loss = evaluate(model, val, seq_len)
    # bits per byte: nats/token -> bits/token, times tokens per byte of the held-out text
    bpb = val_loss / math.log(2) * len(val) / val_bytes
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(dict(bos_token_id=eot, eos_token_id=eot), indent=2) + "\n")
    (out / "tokenizer.json").write_text(tok.to_str())
    (out / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token=EOT, eos_token=EOT, model_max_length=1024), indent=2) + "\n")
    record = dict(
        size=size, parameters=sum(p.numel() for p in model.parameters()), steps=steps, batch_size=batch_size,
        seq_len=seq_len, tokens_seen=steps * batch_size * seq_len, peak_lr=lr, seed=seed,
        wall_time_s=round(wall, 1), threads=torch.get_num_threads(), val_loss_nats_per_token=round(val_loss, 4),
        val_bits_per_byte=round(bpb, 4), train_tokens=int(len(train)), val_tokens=int(len(val)), val_bytes=val_bytes,
        corpus=dict(source="Python standard library .py files (no test dirs, files <= 200 kB)",
                    python=platform.python_version(), train_files=len(train_files), val_files=len(val_files),
                    split="validation = sha1(relative path) % 40 == 0"),
        machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(), torch=torch.__version__),
        log=log)
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"[{size}] done: {wall:.0f}s, val loss {val_loss:.3f} nats/token, {bpb:.3f} bits/byte -> {out}")
    return record


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["tokenizer", "model", "smoke"])
    ap.add_argument("--size", choices=["base", "draft"], default="base")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    tok_file = OUT / "tokenizer.json"
    if args.stage == "tokenizer":
        train_files, _ = corpus_files()
        t0 = time.time()
        tok = train_tokenizer(train_files)
        OUT.mkdir(parents=True, exist_ok=True)
        tok.save(str(tok_file))
        print(f"tokenizer: {tok.get_vocab_size()} tokens from {len(train_files)} files in {time.time() - t0:.0f}s")
    elif args.stage == "model":
        train_model(args.size, args.steps, args.out or OUT / args.size, tok_file, batch_size=args.batch_size,
                    threads=args.threads)
    else:  # smoke: everything end to end on a sliver of the corpus, in seconds
        out = args.out or CACHE / "smoke"
        train_files, _ = corpus_files(limit=60)
        tok = train_tokenizer(train_files, vocab_size=300)
        out.mkdir(parents=True, exist_ok=True)
        tok.save(str(out / "smoke-tokenizer.json"))
        train_model("smoke", args.steps, out, out / "smoke-tokenizer.json", seq_len=32, batch_size=4, file_limit=60)


if __name__ == "__main__":
    main()
