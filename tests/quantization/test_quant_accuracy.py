"""The accuracy table of activation_quantization="int8" (benchmarks/quant_accuracy.py) on
the default model's Q4_1 file, float32: chapter 21 quotes it, measured with the AVX2
kernel build. Its bounds hold on every build; the quote itself is checked where the
kernels are the AVX2 build (an AVX512 build sums the float32 parts in 16 lanes, so its
figures differ a little; ATEN_CPU_CAPABILITY=avx2 gives the AVX2 build there)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.quant_accuracy import accuracy_table, describe
from nanopaged.model.model_loader import ensure_default_gguf

CHAPTER = Path(__file__).resolve().parents[2] / "chapters" / "21-quantization.md"


@pytest.mark.slow
def test_the_chapters_accuracy_table():
    table = accuracy_table(str(ensure_default_gguf(progress=False)))
    assert table["positions"] == 16 * 32
    assert table["agreement"] >= 0.95                     # int8 x moves few greedy choices
    assert 0 < table["mean_abs_dlogprob"] < 0.05          # and the logprobs a little
    assert table["same_free_running"] < table["prompts"]  # not exact: some continuations part
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        text = " ".join(CHAPTER.read_text().split())
        assert describe(table) in text, describe(table)
