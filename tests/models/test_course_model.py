"""The shipped course models: Hugging Face format (transformers loads them), small, with a training record."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanoserve import COURSE_DRAFT_MODEL, COURSE_MODEL, models, tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", [COURSE_MODEL, COURSE_DRAFT_MODEL])
def test_transformers_loads_the_course_model_and_agrees(path):
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = models.load(path, device="cpu", dtype="float32")
    ids = torch.tensor([tokenizer.load(path).encode("def main():\n    return")])
    with torch.no_grad():
        assert (ref(ids).logits - ours(ids)).abs().max().item() <= 1e-4


def test_course_models_share_a_tokenizer_and_fit_the_size_budget():
    base, draft = Path(COURSE_MODEL), Path(COURSE_DRAFT_MODEL)
    assert (base / "tokenizer.json").read_bytes() == (draft / "tokenizer.json").read_bytes()
    total = sum(f.stat().st_size for d in (base, draft) for f in d.iterdir())
    assert total <= 40 * 2**20, f"course models take {total / 2**20:.1f} MiB, the budget is 40 MiB"
    nb, nd = (models.ModelConfig.from_path(d).num_parameters for d in (base, draft))
    assert nb > 4 * nd  # the draft is much smaller: that is what makes it useful for speculation


@pytest.mark.parametrize("path", [COURSE_MODEL, COURSE_DRAFT_MODEL])
def test_training_record(path):
    rec = json.loads((Path(path) / "training.json").read_text())
    for key in ("steps", "tokens_seen", "wall_time_s", "val_bits_per_byte", "seed", "corpus"):
        assert key in rec
    assert 0 < rec["val_bits_per_byte"] < 3.0  # a model that learned something (uniform guessing is ~3.6)


def test_base_model_writes_python():
    model = models.load(COURSE_MODEL, dtype="float32")
    tok = tokenizer.load(COURSE_MODEL)
    ids = torch.tensor([tok.encode("import os\n\n\ndef ")])
    with torch.no_grad():
        for _ in range(40):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    text = tok.decode(ids[0].tolist())
    assert "(" in text and ":" in text and "\n    " in text, text  # a call or signature, and an indented block


def test_training_script_smoke(tmp_path):
    """CI never retrains; this runs the whole script on a sliver of the corpus with a tiny config."""
    out = subprocess.run([sys.executable, str(REPO / "tools" / "train_course_model.py"), "smoke", "--steps", "3",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rec = json.loads((tmp_path / "training.json").read_text())
    assert rec["steps"] == 3 and rec["val_bits_per_byte"] > 0
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert (ref(ids).logits - models.load(tmp_path)(ids)).abs().max().item() <= 1e-5
